"""What a client without the training stack imports (`lorad submit`, `logs`) loads without torch and friends."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import get_args

from tests.helpers.processes import REPO, child_env

TRAINING_STACK = ("torch", "numpy", "transformers", "diffusers", "peft", "bitsandbytes", "safetensors",
                  "accelerate", "PIL")

CHILD = textwrap.dedent("""
    import sys

    class Refuse:
        # Any import of the training stack fails, as it would on a machine where it is not installed.
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is not installed here")
            return None

    BLOCKED = set(sys.argv[1].split(","))
    sys.meta_path.insert(0, Refuse())
    import engine.config.job, engine.errors, engine.report.events, engine.training.stop
    import engine.importers  # lorad import / check / submit of another trainer's config
    from engine.config.job import load_job
    for job in sys.argv[2:]:
        load_job(job)  # validation with its path checks: data folders, built-in model names
    print("ok", sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
""")


def test_config_errors_events_and_stop_import_and_validate_jobs_without_the_training_stack():
    jobs = [REPO / "configs" / "examples" / "quickstart.yaml", REPO / "configs" / "examples" / "flux-lora-tiny.yaml"]
    out = subprocess.run([sys.executable, "-c", CHILD, ",".join(TRAINING_STACK), *map(str, jobs)],
                         capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok []"


def test_the_dtype_table_covers_exactly_the_dtypes_a_job_may_name():
    from engine.config.model import ModelConfig
    from engine.training.dtypes import DTYPES

    assert set(DTYPES) == set(get_args(ModelConfig.model_fields["dtype"].annotation))
