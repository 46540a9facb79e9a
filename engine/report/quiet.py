"""Library noise off the terminal, real warnings kept: one switch per source, thrown before the library loads.

Where the noise comes from, and the switch for each:

- bitsandbytes logs through Python `logging` with no handler of its own (so
  logging's last-resort handler prints it on stderr) which optional kernels
  and native builds it could not load when imported, e.g. "Failed to load CPU
  gemm_4bit_forward from kernels-community" on CPUs with AVX512-BF16: its
  logger is set to ERROR.
- transformers and diffusers log advice and deprecations through their own
  loggers and stderr handlers: TRANSFORMERS_VERBOSITY / DIFFUSERS_VERBOSITY,
  read when they are imported, say `error`.
- Progress bars (tqdm): hub downloads and transformers' weight loading read
  HF_HUB_DISABLE_PROGRESS_BARS when imported; diffusers' loading bars have
  only an API switch (tqdm's own TQDM_DISABLE is read when tqdm is imported,
  and torch imports it first), thrown by `quiet_libraries(diffusers=True)`
  before the Flux family loads anything.
- Python `warnings`: the FutureWarnings transformers, diffusers and peft raise
  about their own APIs, and whatever torchvision and tqdm warn while being
  imported, are ignored.

Everything else is a real warning. A daemon child (`--progress json`) leaves
it on stderr, which the daemon keeps in trainer.log; a foreground run (`lorad
run`) records it as a `library_warning` event in events.jsonl instead
(`warnings_to_events`), so the terminal holds lorad's own lines and nothing is
lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator

# Read by each library when it is imported; a value the user set is kept.
ENV = {"TRANSFORMERS_VERBOSITY": "error", "DIFFUSERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
QUIET_LOGGERS = ("bitsandbytes",)
IGNORED_WARNINGS = (
    (FutureWarning, r"(transformers|diffusers|peft)\."),
    (Warning, r"torchvision(\.|$)"),
    (Warning, r"tqdm(\.|$)"),
)


def quiet_libraries(diffusers: bool = False) -> None:
    """Throw every switch above, process-wide and idempotent; `diffusers=True` also imports diffusers' logging."""
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for category, module in IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", category=category, module=module)
    # Libraries imported before this call (an in-process caller, a second run) read no environment any more.
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
    if diffusers or "diffusers" in sys.modules:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()
        diffusers_logging.disable_progress_bar()


class _ToEvents(logging.Handler):
    def __init__(self, log) -> None:
        super().__init__(logging.WARNING)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        self.log.warning("library_warning", source=record.name, message=record.getMessage()[:2000])


@contextlib.contextmanager
def warnings_to_events(log) -> Iterator[None]:
    """While inside: Python warnings and library log records (WARNING and up) become `library_warning` events."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        log.warning("library_warning", source=f"{filename}:{lineno}", category=category.__name__,
                    message=str(message)[:2000])

    handler = _ToEvents(log)
    root = logging.getLogger()
    with warnings.catch_warnings():
        warnings.showwarning = show
        root.addHandler(handler)
        try:
            yield
        finally:
            root.removeHandler(handler)
