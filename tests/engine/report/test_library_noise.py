"""A foreground run prints lorad's own lines only; a daemon child still shows real warnings to trainer.log.

Both runs train the micro model for two steps in a real process. At the first step the family hook emits what
the libraries emit: bitsandbytes' import chatter (a `logging` warning on its logger, as when it cannot load an
optional kernel) and a genuine `warnings.warn`.
"""

from __future__ import annotations

import subprocess
import textwrap

import yaml

from tests.helpers.jobs import QUICKSTART_DATA, deep_update, read_events, tiny_job_dict
from tests.helpers.processes import PY, REPO, child_env

CHATTER = "Failed to load CPU gemm_4bit_forward from kernels-community"
REAL = "lorad-test: a real warning"

CHILD = textwrap.dedent(f"""
    import logging, sys, warnings
    from engine.families.causal_lm import CausalLM

    def on_step_end(self, model, step, cfg, workdir, log):
        if step == 1:
            logging.getLogger("bitsandbytes.backends.cpu.ops").warning("{CHATTER}: no module named 'kernels'")
            warnings.warn("{REAL}", UserWarning)

    CausalLM.on_step_end = on_step_end
    if sys.argv[1] == "foreground":
        from daemon.client.cli import main
        sys.exit(main(["run", sys.argv[2], "--home", sys.argv[3], "--quiet"]))
    from tests.helpers.processes import trainer_main as main
    sys.exit(main(["--job", sys.argv[2], "--workdir", sys.argv[3], "--progress", "json"]))
""")


def test_lorad_run_prints_only_its_own_lines_and_a_daemon_child_keeps_real_warnings(tmp_path, micro_model):
    job = tmp_path / "tiny.yaml"
    job.write_text(yaml.safe_dump(deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA),
                                              {"train": {"steps": 2, "warmup_steps": 0}})))
    home, workdir = tmp_path / "home", tmp_path / "child"
    # Side by side: each spends most of its life importing torch and transformers.
    runs = {mode: subprocess.Popen([PY, "-c", CHILD, mode, str(job), str(where)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=child_env(), cwd=REPO)
            for mode, where in (("foreground", home), ("child", workdir))}
    out = {mode: (p.communicate(timeout=300), p.returncode) for mode, p in runs.items()}

    (_, err), rc = out["foreground"]
    assert rc == 0, err
    assert err and all(line.startswith("lorad:") for line in err.splitlines()), err
    recorded = [e for e in read_events(home / "jobs" / "tiny") if e["event"] == "library_warning"]
    # Not on the terminal, not lost. Other libraries' warnings of the day (a newer release's) go to the events
    # too, and are no business of this test: it asserts lorad's behaviour, not the quiet of its dependencies.
    assert REAL in [e["message"] for e in recorded]
    assert CHATTER not in " ".join(e["message"] for e in recorded)  # import chatter is dropped, not recorded

    (stdout, err), rc = out["child"]
    assert rc == 0, err
    assert REAL in err and "UserWarning" in err  # stderr is trainer.log under the daemon
    assert CHATTER not in err + stdout
