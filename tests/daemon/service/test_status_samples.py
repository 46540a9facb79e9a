"""`lorad status ID` lists the newest sample images a Flux job rendered, so over-fitting is caught early."""

from __future__ import annotations

from daemon.client.render import print_detail
from daemon.protocol import JobDetail
from daemon.service.handlers import latest_samples


def _png(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n")


def test_the_newest_step_with_images_is_reported(tmp_path):
    _png(tmp_path / "samples" / "step-00000004" / "00.png")
    _png(tmp_path / "samples" / "step-00000008" / "00.png")
    _png(tmp_path / "samples" / "step-00000008" / "01.png")
    (tmp_path / "samples" / "step-00000012").mkdir()  # being rendered: no image yet
    step, paths = latest_samples(tmp_path)
    assert step == 8
    assert [p.rsplit("/", 2)[-2:] for p in paths] == [["step-00000008", "00.png"], ["step-00000008", "01.png"]]


def test_links_and_odd_names_the_trainer_user_put_in_samples_are_never_listed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    _png(elsewhere / "step-00000099" / "secret.png")
    wd = tmp_path / "job"
    _png(wd / "samples" / "step-00000004" / "00.png")
    (wd / "samples" / "step-00000009").symlink_to(elsewhere / "step-00000099")  # a linked step: not listed
    _png(wd / "samples" / "step-x" / "01.png")  # not a step: left out (its int() raised ValueError)
    assert latest_samples(wd) == (4, [str(wd / "samples" / "step-00000004" / "00.png")])
    other = tmp_path / "other"
    other.mkdir()
    (other / "samples").symlink_to(elsewhere)
    assert latest_samples(other) == (None, [])


def test_a_job_without_samples_reports_none(tmp_path):
    assert latest_samples(tmp_path) == (None, [])


def test_status_detail_prints_every_sample_path(tmp_path, capsys):
    paths = [str(tmp_path / "samples" / "step-00000008" / f"0{i}.png") for i in range(2)]
    detail = JobDetail(id="flux-1", name="flux", state="running", priority=0, step=9, total=20,
                       workdir=str(tmp_path), submitted_at=0.0, samples_step=8, samples=paths)
    print_detail({"job": detail.model_dump()})
    out = capsys.readouterr().out
    assert "samples (step 8)" in out
    assert all(p in out for p in paths)
