"""Worker for tests/test_ddp.py (run by torchrun, 2 CPU ranks, gloo).

Patched tiny Llamas, on the adapter store and on the per-parameter path (``adapter_store=False``) with
``torch.optim.AdamW``, and on the store with ``fast_multilora.AdamW``, each wrapped in ``DistributedDataParallel`` and
trained for a few steps (no dropout): each step
accumulates two micro-batches, the first inside ``ddp.no_sync()``; each rank takes its half of a global batch, with
different adapter mixes (one rank lacks an adapter the other has). Every rank saves its LoRA weights, its gradients
after the first step's backward, the ``.grad`` that are ``None`` then, and how many layer calls took the store's
leaves (``"stored"``) or PEFT's parameters (``"params"``) in each model's forwards, outside any compiled graph.

With a second argument ``compile``: the store's run with ``torch.optim.AdamW`` only, under ``torch.compile(ddp,
backend="aot_eager")`` (Dynamo's graph count saved too).
"""

import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fast_multilora
from fast_multilora import patching
from fast_multilora.training import distributed_per_adapter_loss

VOCAB = ["a0", "a1", "a2"]
STEPS, MICRO, ROWS = 3, 2, 8
# per micro-batch (two per step) the names of the global batch; the first half goes to rank 0, the second to rank 1.
# Every adapter is in each step's global batch (an adapter in no batch keeps .grad None in one process); rank 1 lacks
# a0 in all of step 0, rank 0 lacks a0 and a1 in a micro-batch of step 1, rank 1 has base rows only in one of step 2.
MIXES = [
    ["a0", "a1", "a0", "__base__", "a1", "a2", "a2", "a1"],
    ["a2", "a0", "__base__", "a2", "a1", "a1", "a2", "__base__"],
    ["a2", "a2", "__base__", "a2", "a0", "a1", "a0", "a0"],
    ["a1", "a0", "a1", "a1", "a0", "a2", "a2", "a0"],
    ["a1", "a0", "a2", "a0", "__base__", "__base__", "__base__", "__base__"],
    ["__base__", "a0", "a2", "a0", "a1", "a1", "a1", "a2"],
]


def batches():
    """``[(ids [ROWS, 9], labels, names)]`` per micro-batch, ``STEPS * MICRO`` of them."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(STEPS * MICRO):
        ids = torch.randint(0, 97, (ROWS, 9), generator=g)
        labels = ids.clone()
        labels[:, : 2 + i % 3] = -100  # different token counts per micro-batch and rank
        labels[i % ROWS, 6:] = -100
        out.append((ids, labels, MIXES[i % len(MIXES)]))
    return out


def _count_calls(counts, real):
    def run_layer(*args):  # a call Dynamo traces is in the graph, not counted (no side effect for it to replay)
        if not torch.compiler.is_compiling():
            counts[args[1][0]] = counts.get(args[1][0], 0) + 1
        return real(*args)

    patching.run_layer = run_layer


def optimizer(model, kind):
    if kind == "fast":
        return fast_multilora.AdamW(model, lr=1e-2)
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def train(model, rank, world, kind, compiled=False):
    ddp = DDP(model)
    fwd = torch.compile(ddp, backend="aot_eager") if compiled else ddp
    opt = optimizer(model, kind)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    first_grads = none_grads = None
    model.train()
    for step in range(STEPS):
        for m in range(MICRO):
            ids, labels, names = batches()[step * MICRO + m]
            names = names[rows]
            with ddp.no_sync() if m < MICRO - 1 else torch.enable_grad():
                out = fwd(input_ids=ids[rows], adapter_names=names)
                loss = distributed_per_adapter_loss(out.logits, labels[rows], names, VOCAB) / MICRO
                loss.backward()
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            none_grads = sorted(n for n, p in model.named_parameters() if p.requires_grad and p.grad is None)
        opt.step()
        opt.zero_grad()
    return first_grads, none_grads


def main(out_path, compiled=False):
    from torch._dynamo.utils import counters

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from models import lora_weights, peft_model

    result = {"world": world}
    real = patching.run_layer
    kinds = (("store", True),) if compiled else (("store", True), ("params", False), ("fast", True))
    for kind, store in kinds:
        torch.manual_seed(100 + rank)  # rank-dependent adapter weights: the store's broadcast must even them out
        model = peft_model("llama", seed=0)
        if rank:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_" in n:
                        p.add_(torch.randn_like(p))
        fast_multilora.patch(model, backend="torch", adapter_store=store)
        counts = {}
        _count_calls(counts, real)
        torch._dynamo.reset()
        counters.clear()
        t0 = time.perf_counter()
        grads, none = train(model, rank, world, kind, compiled)
        result[kind] = {"weights": lora_weights(model), "grads": grads, "none": none, "counts": counts,
                        "seconds": time.perf_counter() - t0, "graphs": counters["stats"]["unique_graphs"]}
        if store:
            s = fast_multilora.store.AdapterStore.of(model)
            result[kind]["ddp_layers"] = len(s.ddp.layers)
            result[kind]["held_layers"] = len(s.slots)
        patching.run_layer = real
    torch.save(result, f"{out_path}.{rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], compiled=sys.argv[2:] == ["compile"])
