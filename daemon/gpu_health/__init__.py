"""GPU health: what a GPU says about itself, whether it may be scheduled, and the VRAM other programs hold.

    reading.py      one reading of one GPU (lost, unknown error, Xid events, ECC, row remaps, throttle, processes)
                    and what each means (fatal Xids, thermal or hardware slowdown)
    nvml.py         the readings from NVML (event sets, counters); the simulated device makes its own
                    (daemon/power/simulated.py, with faults tests inject)
    verdict.py      per GPU: ok → quarantined → held, and back (pure: readings and a clock in, verdicts out)
    watcher.py      a thread that reads every GPU every interval_s and keeps the verdicts

What the supervisor does about the verdicts (stop a trainer on a quarantined GPU, its job `waiting_for_gpu` with
no crash counted, requeued when a healthy GPU is there; bad GPUs kept out of scheduling; VRAM others hold planned
for or waited for, `gpu_memory_policy`) is its own part: daemon/supervisor/gpu_path.py.

The daemon never initialises CUDA (daemon/supervisor/devices.py): everything here goes through NVML.
"""
