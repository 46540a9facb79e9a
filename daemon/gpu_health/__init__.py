"""GPU health: what a GPU says about itself, whether it may be scheduled, and the VRAM other programs hold.

    reading.py      one reading of one GPU (lost, unknown error, Xid events, ECC, row remaps, throttle, processes)
                    and what each means (fatal Xids, thermal or hardware slowdown)
    nvml.py         the readings from NVML (event sets, counters); the simulated device makes its own
                    (daemon/power/simulated.py, with faults tests inject)
    verdict.py      per GPU: ok → quarantined → held, and back (pure: readings and a clock in, verdicts out)
    watcher.py      a thread that reads every GPU every interval_s and keeps the verdicts
    supervision.py  what the supervisor does about them: stops a trainer on a quarantined GPU (its job goes
                    `waiting_for_gpu`, no crash counted), requeues it when a healthy GPU is there, keeps bad GPUs
                    out of scheduling, plans for or waits for VRAM others hold (`gpu_memory_policy`)

The daemon never initialises CUDA (daemon/supervisor/devices.py): everything here goes through NVML.
"""
