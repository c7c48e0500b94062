"""Worker for tests/integration/test_accelerate.py's FSDP2 tests (run by torchrun, 2 CPU ranks, gloo).

``sharded``: FSDP2 (``fully_shard``) shards the frozen base and the adapters of a patched tiny Llama per decoder layer;
each rank takes its half of a global mixed batch and backpropagates ``distributed_per_adapter_loss``. Rank 0 saves
the full (gathered) LoRA gradients and the per-adapter gradient norms, which must equal one process's on the global
batch, and the LoRA weights after one ``fast_multilora.AdamW`` step (its store holds no sharded parameter: torch's
AdamW math).

``store``: the same with ``ignored_params=fast_multilora.fsdp_ignored_params(model)``: the base sharded, the adapters
replicated in the adapter store, which broadcasts them (rank 1 starts from other LoRA weights) and all-reduces their
gradients; two micro-batches (the rank's rows twice), the first under ``set_requires_gradient_sync(False)``, then one
step of the user's ``torch.optim.AdamW(model.parameters())``.
"""

import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fast_multilora
from fast_multilora.data import adapter_param_groups, clip_grad_norm_per_adapter
from fast_multilora.store import AdapterStore
from fast_multilora.training import distributed_per_adapter_loss


def global_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (8, 9), generator=g)
    names = ["a0", "a1", "a1", "__base__", "a2", "a1", "a0", "a0"]  # different adapter mixes on the two ranks
    labels = ids.clone()
    labels[:, :3] = -100
    labels[1, 5:] = -100  # and different token counts
    return ids, labels, names


def main(out_path, mode="sharded"):
    if mode == "store":
        return main_store(out_path)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from models import peft_model

    model = peft_model("llama")
    fast_multilora.patch(model, backend="torch")
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = fast_multilora.AdamW(model, lr=1e-2)  # sharded parameters: the store holds none, torch's AdamW math steps
    ids, labels, names = global_batch()
    rows = slice(rank * len(names) // world, (rank + 1) * len(names) // world)
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(input_ids=ids[rows], adapter_names=names[rows])
    loss = distributed_per_adapter_loss(out.logits, labels[rows], names[rows], ["a0", "a1", "a2"])
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    # per-adapter clipping on DTensor gradients: the norms are global (over both ranks' shards)
    norms = clip_grad_norm_per_adapter(adapter_param_groups(model), max_norm=1e-3)
    sharded = sum(type(p).__name__ == "DTensor" for p in model.parameters())
    held = sum(len(a.blocks) for a in opt.store.arenas.values())
    opt.step()
    stepped = {n: p.full_tensor() for n, p in model.named_parameters() if "lora_" in n}
    if rank == 0:
        n_params = sum(1 for _ in model.parameters())
        torch.save({"grads": grads, "norms": norms, "sharded": sharded, "params": n_params, "held": held,
                    "stepped": stepped, "warnings": [str(w.message) for w in caught]}, out_path)
    dist.destroy_process_group()


def main_store(out_path):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from models import peft_model

    model = peft_model("llama")
    fast_multilora.patch(model, backend="torch")
    if rank == 1:  # the store's broadcast at the first forward gives every rank rank 0's adapters
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.add_(1.0)
    ignored = fast_multilora.fsdp_ignored_params(model)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    store = AdapterStore.of(model)
    ids, labels, names = global_batch()
    rows = slice(rank * len(names) // world, (rank + 1) * len(names) // world)
    model.train()
    probe = next(p for n, p in model.named_parameters() if "lora_B" in n and p.requires_grad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.set_requires_gradient_sync(False)
        out = model(input_ids=ids[rows], adapter_names=names[rows])
        distributed_per_adapter_loss(out.logits, labels[rows], names[rows], ["a0", "a1", "a2"]).backward()
        local = [torch.zeros_like(probe.grad) for _ in range(world)]
        dist.all_gather(local, probe.grad.clone())  # not reduced yet: each rank's own rows
        model.set_requires_gradient_sync(True)
        out = model(input_ids=ids[rows], adapter_names=names[rows])
        distributed_per_adapter_loss(out.logits, labels[rows], names[rows], ["a0", "a1", "a2"]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    views = sum(p.grad is not None and p.grad.untyped_storage().data_ptr() ==
                store.arenas[(p.dtype, p.device)].grad.untyped_storage().data_ptr()
                for n, p in model.named_parameters() if "lora_" in n)
    opt.step()
    stepped = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    gathered = [None] * world
    dist.all_gather_object(gathered, {"grads": grads, "stepped": stepped})
    if rank == 0:
        torch.save({"grads": grads, "stepped": stepped, "others": gathered[1:], "local": local,
                    "held": len(store.held), "lora": sum("lora_" in n for n, _ in model.named_parameters()),
                    "sharded": sum(type(p).__name__ == "DTensor" for p in model.parameters()),
                    "params": sum(1 for _ in model.parameters()), "views": views, "active": store.ddp.active,
                    "warnings": [str(w.message) for w in caught]}, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
