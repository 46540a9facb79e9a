"""Block swapping: train a model larger than VRAM by streaming its frozen blocks from host memory.

`train.blocks_to_swap: N` keeps the frozen weights of the last N transformer
blocks in pinned host memory. Each swapped block is copied to the GPU on a
side stream just before it is needed and dropped right after, with a window
of two swapped blocks on the GPU at any moment (double buffering):

    forward,  entering block i:        keep {i, i+1}; wait for i; start copying i+1
    backward, gradient reaches block i: keep {i, i-1}; wait for i; start copying i-1

so block i±1 crosses PCIe while block i computes. The last blocks are the
swapped ones because the backward pass starts where the forward ends: the
last block is still resident when backward begins, and the first resident
blocks need no copy at the start of the next step.

Only frozen parameters move (the base weights, FP8 or bf16); LoRA parameters,
their gradients and optimizer state stay on the GPU. Parameters move by
swapping `param.data`, which keeps the same Parameter object. Autograd must
not keep the device copy alive behind our back: a plain `nn.Linear` saves
`weight.t()` — a view of the device copy that eviction cannot reach — so an
evicted block would hold its GPU memory until backward and the forward would
save nothing. The frozen linears of swapped blocks therefore run through
`_FrozenLinear`, which saves nothing and reads the weight from the module at
backward time, when the swapper has loaded it again (our FP8 layer does the
same by design).

Each block's frozen weights live in one host buffer and are copied in one
transfer into one device buffer (views carve out the parameters). The host
buffer is allocated at its exact size and then page-locked with
cudaHostRegister: torch's pinned allocator (`pin_memory=True`) rounds every
allocation up to a power of two, so a 283 MB FLUX.1 single block would take
512 MiB and swapping all 57 blocks would lock about 41 GB to hold 24 GB.

The window of two is also kept on the device, not only in Python. An evicted
device buffer carries `record_stream(compute)`, so the allocator cannot reuse
it until the compute stream has passed it; a CPU running ahead would start
further loads into fresh memory and reserved memory would grow past two
blocks (the pattern of PyTorch issue #147168). So each eviction records an
event on the compute stream, and the next load waits on it on the CPU first.
The cost is one short GPU bubble per swapped block (the CPU's launch latency).

All CUDA calls go through `CudaOps` (engine/frozen_base/swap_ops.py); on the CPU `HostOps` stands in, and
tests drive the swapper with a recording fake of the same four calls.

Backward is detected with gradient hooks on every output of a block that
needs a gradient (whichever arrives first acts; Flux's last single block
never receives a gradient for its context output). Under activation
checkpointing, a block's forward runs again during backward; the forward hook
sees it (torch reports a current graph task) and only makes sure the block is
resident.

On the CPU the "device" copy is a fresh CPU tensor: every step of the logic
(which block is resident, when copies start and end) runs and is tested, and
the copies cost a memcpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from engine.errors import JobInvalid
from engine.frozen_base.swap_ops import CudaOps, HostOps, LastUse, owned_host_buffer


@dataclass
class SwapStats:
    loads: int = 0
    evictions: int = 0
    max_resident: int = 0
    trace: list[tuple[str, int]] = field(default_factory=list)  # ("load"/"evict"/"wait", block index)
    keep_trace: bool = False

    def note(self, what: str, i: int) -> None:
        if self.keep_trace:
            self.trace.append((what, i))


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class BlockSwapper:
    def __init__(self, blocks: list[nn.Module], blocks_to_swap: int, device: torch.device, keep_trace: bool = False,
                 ops=None):
        if blocks_to_swap < 0 or blocks_to_swap > len(blocks):
            raise ValueError(f"train.blocks_to_swap must be between 0 and the number of blocks ({len(blocks)}), "
                             f"got {blocks_to_swap}")
        self.blocks = list(blocks)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        first = len(blocks) - blocks_to_swap
        self.swapped = list(range(first, len(blocks)))
        self.stats = SwapStats(keep_trace=keep_trace)
        self._ops = ops or (CudaOps(self.device) if self.cuda else HostOps())  # ops: tests' recording fake
        self._released: list[object] = []  # compute-stream events of evictions the next load waits for
        # Per swapped block: its frozen params, one flat host buffer with a view per param, and (when
        # resident) a ready event.
        self._params: dict[int, list[nn.Parameter]] = {}
        self._flat: dict[int, torch.Tensor] = {}
        self._offsets: dict[int, list[int]] = {}  # byte offset of each param in the flat buffer (fixed)
        self._host: dict[int, list[torch.Tensor]] = {}
        self._last_use: dict[int, LastUse] = {}  # the last upload from each host buffer, waited for at its release
        self._resident: dict[int, object] = {}
        self._hooks = []
        self._frozen_linears: list[nn.Linear] = []
        for i in self.swapped:
            params = [p for p in blocks[i].parameters() if not p.requires_grad]
            self._params[i] = params
            self._offsets[i] = _layout(params)
            self._flat[i], self._last_use[i] = self._pack_host(params, self._offsets[i])
            self._host[i] = _views(self._flat[i], params, self._offsets[i])
            for p, h in zip(params, self._host[i], strict=True):
                p.data = h
            for m in blocks[i].modules():
                if type(m) is nn.Linear and not m.weight.requires_grad:
                    m.forward = _FrozenLinear.forward_of(m)
                    self._frozen_linears.append(m)
        for i, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(self._make_pre_hook(i)))
            self._hooks.append(block.register_forward_hook(self._make_post_hook(i)))
        if self.cuda:
            torch.cuda.empty_cache()  # hand the freed block memory back before training allocates

    def _pack_host(self, params: list[nn.Parameter], offsets: list[int]) -> tuple[torch.Tensor, LastUse]:
        """One exactly-sized (page-locked, on CUDA) byte buffer with every param's bytes at ALIGN-aligned offsets.

        Its registration lives as long as the buffer (swap_ops.owned_host_buffer): dropping the model releases it.
        """
        flat, last_use = owned_host_buffer(self._ops, offsets[-1])
        for p, v in zip(params, _views(flat, params, offsets), strict=True):
            v.copy_(p.data)  # from the host (place_model left it there) or from the GPU
        return flat, last_use

    # -- residency
    def _load(self, i: int) -> None:
        """Start copying block i to the device (asynchronously on CUDA)."""
        if i not in self._params or i in self._resident:
            return
        for ev in self._released:  # the evicted blocks' memory is free on the device before more is taken
            self._ops.wait_for(ev)
        self._released.clear()
        self.stats.loads += 1
        self.stats.note("load", i)
        dev, ready = self._ops.upload(self._flat[i])
        self._last_use[i].event = ready
        self._resident[i] = (ready, dev)
        for p, v in zip(self._params[i], _views(dev, self._params[i], self._offsets[i]), strict=True):
            p.data = v
        self.stats.max_resident = max(self.stats.max_resident, len(self._resident))

    def _wait(self, i: int) -> None:
        """Block i must be on the device before its kernels are queued."""
        if i not in self._params:
            return
        if i not in self._resident:
            self._load(i)
        self.stats.note("wait", i)
        ready, dev = self._resident[i]
        if ready is not None:
            self._ops.use(dev, ready)
            self._resident[i] = (None, dev)

    def _evict_except(self, keep: set[int]) -> None:
        for i in [j for j in self._resident if j not in keep]:
            for p, h in zip(self._params[i], self._host[i], strict=True):
                p.data = h  # host copies are never written: the base is frozen, nothing to copy back
            del self._resident[i]
            self._released.append(self._ops.mark(i))
            self.stats.evictions += 1
            self.stats.note("evict", i)

    # -- hooks
    def _make_pre_hook(self, i: int):
        def pre_hook(module, args):
            if _in_backward():  # activation-checkpoint recompute: only make sure it is here
                self._wait(i)
                return
            self._evict_except({i, i + 1})
            self._wait(i)
            self._load(i + 1)
        return pre_hook

    def _make_post_hook(self, i: int):
        def post_hook(module, args, output):
            if _in_backward() or not torch.is_grad_enabled():
                return
            hook = self._make_grad_hook(i)
            for t in _grad_tensors(output):
                t.register_hook(hook)  # idempotent: the first gradient to arrive does the work
        return post_hook

    def _make_grad_hook(self, i: int):
        def grad_hook(grad):
            self._evict_except({i, i - 1})
            self._wait(i)
            self._load(i - 1)
            return None
        return grad_hook

    def resident(self) -> list[int]:
        return sorted(self._resident)

    def remove(self) -> None:
        """Detach the hooks; the swapped blocks' frozen weights stay in their host buffers.

        Nothing is loaded: bringing every swapped block to the device at once is exactly what a card that needed
        swapping cannot hold. A caller that wants them there moves them itself. The host buffers are released with
        the model (owned_host_buffer), so dropping the model needs no call here at all.
        """
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for m in self._frozen_linears:
            del m.forward  # back to nn.Linear.forward
        self._frozen_linears.clear()
        self._evict_except(set())


class _FrozenLinear(torch.autograd.Function):
    """y = x Wᵀ + b for a frozen linear that saves nothing; backward reads W from the module.

    nn.Linear would save a view of the weight's device copy (see the module docstring); this reads the
    weight again at backward time, after the swapper loaded the block back.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
        ctx.module = module
        return nn.functional.linear(x, module.weight, module.bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        w = ctx.module.weight
        return dy @ w.to(dy.dtype), None

    @staticmethod
    def forward_of(module: nn.Linear):
        return lambda x: _FrozenLinear.apply(x, module)


ALIGN = 256  # bytes: every view in a flat buffer starts aligned (FP8 matmuls need 16)


def _layout(params: list[nn.Parameter]) -> list[int]:
    """Byte offsets of each param in a flat buffer, and the total size as the last entry."""
    offsets, at = [], 0
    for p in params:
        offsets.append(at)
        at += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
    return offsets + [at]


def _views(flat: torch.Tensor, params: list[nn.Parameter], offsets: list[int]) -> list[torch.Tensor]:
    """Each param's dtype and shape over its bytes in `flat` (offsets from _layout)."""
    out = []
    for p, off in zip(params, offsets, strict=False):
        n = p.numel() * p.element_size()
        out.append(flat[off:off + n].view(p.dtype).view(p.shape))
    return out


def _grad_tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _grad_tensors(o)]
    return []


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, in forward order: the longest ModuleList(s) of identical module types.

    Flux has two lists (transformer_blocks then single_transformer_blocks); they
    are concatenated in that order, which is the order the forward runs them.
    """
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) >= 2
             and len({type(b) for b in m}) == 1]
    # A ModuleList nested inside another candidate's block (e.g. peft's) is not a block list.
    top = [m for m in lists if not any(m is not o and any(m is s for s in o.modules()) for o in lists)]
    top = [m for m in top if len(m) >= 2]
    if not top:
        return []
    biggest = max(sum(p.numel() for p in m.parameters()) for m in top)
    # keep lists holding at least a tenth of the largest one's parameters (drops small helper lists)
    chosen = [m for m in top if sum(p.numel() for p in m.parameters()) * 10 >= biggest]
    return [b for m in chosen for b in m]


def swapped_blocks(model: nn.Module, blocks_to_swap: int) -> list[nn.Module]:
    """The blocks `train.blocks_to_swap: N` streams: the last N of find_blocks (all of them if N is larger)."""
    if not blocks_to_swap:
        return []
    blocks = find_blocks(model)
    if not blocks:
        raise JobInvalid("train.blocks_to_swap: this model has no repeated transformer blocks to swap")
    return blocks[len(blocks) - min(blocks_to_swap, len(blocks)):]


def host_weights(model: nn.Module, blocks_to_swap: int) -> set[int]:
    """ids of the frozen parameters block swapping streams (what must never be moved to the GPU whole)."""
    return {id(p) for b in swapped_blocks(model, blocks_to_swap) for p in b.parameters() if not p.requires_grad}


def place_model(model: nn.Module, device: torch.device, blocks_to_swap: int = 0,
                host: torch.device = torch.device("cpu")) -> int:
    """`model.to(device)`, except the frozen weights of the blocks that will be swapped: those go to `host`.

    Loading the whole model onto the GPU and then moving the swapped blocks out (what BlockSwapper alone
    would do) needs the whole base on the GPU once: a 24 GB bf16 Flux could never load on a 24 GB card,
    whatever N. Placed this way the load peak is the resident part only. LoRA weights, buffers (FP8
    scales included) and everything outside the swapped blocks go to `device`. `host` is the CPU; tests
    pass another device to tell the two apart. Returns the bytes left on the host.
    """
    keep = host_weights(model, blocks_to_swap)
    if not keep:
        model.to(device)
        return 0
    device, host = torch.device(device), torch.device(host)

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(host if id(t) in keep else device)

    for mod in model.modules():
        mod._apply(move, recurse=False)  # per module, so FP8Linear's _apply re-resolves its compute path
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) in keep)
