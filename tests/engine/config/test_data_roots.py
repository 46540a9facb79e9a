"""Every file in a job's data folders lies under the daemon's allowed roots, not only the folder (issue 23):
a symlink inside an allowed folder to a file or a folder elsewhere refuses the job, naming the entry, where it
leads and the roots; a link that stays inside the roots is fine."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from engine.config.job import load_job
from engine.config.policy import JobPolicy
from engine.errors import JobInvalid

DATA_KEYS = [("data", "path"), ("data", "masks", "path"), ("data", "regularisation", "path"),
             ("data", "validation", "path")]


def raw_job(keys: tuple[str, ...], folder: Path) -> dict:
    raw: dict = {}
    node = raw
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = str(folder)
    return raw


@pytest.fixture
def tree(tmp_path):
    """root/ (allowed) with a data folder; elsewhere/ (not allowed) with a secret and a folder of files."""
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    (root / "data" / "sub").mkdir(parents=True)
    (root / "data" / "a.txt").write_text("fine\n")
    (root / "data" / "sub" / "b.txt").write_text("fine\n")
    (root / "shared").mkdir()
    (root / "shared" / "c.txt").write_text("fine, through a link\n")
    (elsewhere / "folder").mkdir(parents=True)
    (elsewhere / "secret").write_text("root:$6$...\n")
    (elsewhere / "folder" / "d.txt").write_text("someone else's\n")
    return root, elsewhere, JobPolicy(False, (root.resolve(),))


@pytest.mark.parametrize("keys", DATA_KEYS, ids=lambda k: ".".join(k))
def test_a_symlink_to_a_file_outside_the_roots_refuses_the_job_naming_the_file_and_the_roots(tree, keys):
    root, elsewhere, policy = tree
    (root / "data" / "sub" / "shadow.txt").symlink_to(elsewhere / "secret")
    name = ".".join(keys)
    with pytest.raises(JobInvalid, match=rf"^{re.escape(name)}: sub/shadow.txt in .* resolves to "
                                         rf"{re.escape(str((elsewhere / 'secret').resolve()))}, outside the allowed "
                                         rf"roots \({re.escape(str(root.resolve()))}\)"):
        policy.check(raw_job(keys, root / "data"), root)


def test_a_symlinked_subfolder_leading_outside_the_roots_refuses_the_job(tree):
    root, elsewhere, policy = tree
    (root / "data" / "more").symlink_to(elsewhere / "folder")
    with pytest.raises(JobInvalid, match=r"^data\.path: more in .* outside the allowed roots"):
        policy.check(raw_job(("data", "path"), root / "data"), root)


def test_a_link_inside_a_linked_folder_inside_the_roots_is_walked_too(tree):
    root, elsewhere, policy = tree
    (root / "shared" / "leak.txt").symlink_to(elsewhere / "secret")
    (root / "data" / "shared").symlink_to(root / "shared")
    with pytest.raises(JobInvalid, match=r"^data\.path: shared/leak.txt in .* outside the allowed roots"):
        policy.check(raw_job(("data", "path"), root / "data"), root)


def test_links_that_stay_inside_the_roots_are_fine_and_a_link_loop_ends(tree):
    root, _, policy = tree
    (root / "data" / "c.txt").symlink_to(root / "shared" / "c.txt")
    (root / "data" / "shared").symlink_to(root / "shared")
    (root / "data" / "sub" / "loop").symlink_to(root / "data")
    policy.check(raw_job(("data", "path"), root / "data"), root)


def test_the_trainer_refuses_it_when_loading_its_job_and_lorad_run_of_ones_own_job_does_not(tree, tmp_path):
    root, elsewhere, policy = tree
    (root / "data" / "shadow.txt").symlink_to(elsewhere / "secret")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "t", "model": {"path": "builtin:tiny-llama"},
                                   "data": {"path": str(root / "data"), "seq_len": 32}, "train": {"steps": 1}}))
    with pytest.raises(JobInvalid, match=r"^data\.path: shadow.txt in .* outside the allowed roots"):
        load_job(job, policy=policy)
    load_job(job)  # no daemon policy: the user's own files, wherever they lead


@pytest.mark.parametrize("through_folder", [False, True])
def test_an_assistant_lora_outside_the_roots_refuses_the_job(tree, through_folder):
    """model.assistant_lora is read by the trainer: the file, or the one file read from the folder it names."""
    root, elsewhere, policy = tree
    (root / "helper").mkdir()
    (root / "helper" / "pytorch_lora_weights.safetensors").symlink_to(elsewhere / "secret")
    named = root / "helper" if through_folder else root / "helper" / "pytorch_lora_weights.safetensors"
    with pytest.raises(JobInvalid, match=r"^model\.assistant_lora: .*outside the allowed roots"):
        policy.check({"model": {"assistant_lora": str(named)}}, root)
    policy.check({"model": {"assistant_lora": "org/helper-lora"}}, root)  # a hub id is not a path


def test_a_single_file_config_outside_the_roots_refuses_the_job(tree):
    """model.single_file_config (SDXL's single-file base's diffusers config) is read by the trainer."""
    root, elsewhere, policy = tree
    with pytest.raises(JobInvalid, match=r"^model\.single_file_config: .*outside the allowed roots"):
        policy.check({"model": {"single_file_config": str(elsewhere / "folder")}}, root)
    policy.check({"model": {"single_file_config": "stabilityai/stable-diffusion-xl-base-1.0"}}, root)  # a hub id
