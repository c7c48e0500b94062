"""Worker for tests/integration/test_trainer.py::test_trainer_kwargs_under_ddp_matches_one_process (run by torchrun,
1 or 2 CPU ranks, gloo).

An unmodified ``transformers.Trainer`` built by ``fast_multilora.trainer_kwargs`` trains the patched tiny Llama with
SGD (constant lr, no clipping: the update is linear in the gradient, so a wrong loss scale would show) on a fixed
global batch size, split over the ranks by the Trainer. Rank 0 saves the LoRA weights, the logged per-adapter losses,
the world size, and the positions of the logits the model built in each training forward.
"""

import os
import sys

import torch
from transformers import Trainer, TrainingArguments

import fast_multilora


def samples(n=48):
    g = torch.Generator().manual_seed(7)
    names = ["a0", "a1", "a2", "__base__", "a1", "a2"]
    out = []
    for i in range(n):
        k = int(torch.randint(4, 13, (1,), generator=g))
        ids = torch.randint(1, 97, (k,), generator=g)
        labels = ids.clone()
        labels[: 1 + i % 3] = -100  # different token counts per sample, so per rank
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist(), "adapter_name": names[i % len(names)]})
    return out


def main(out_dir, fused, global_batch):
    from models import lora_weights, patched_llama

    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = patched_llama()
    args = TrainingArguments(
        output_dir=out_dir, max_steps=3, per_device_train_batch_size=global_batch // world, learning_rate=0.5,
        optim="sgd", lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0, remove_unused_columns=False,
        max_grad_norm=0.0, ddp_backend="gloo" if world > 1 else None,
    )
    kw = fast_multilora.trainer_kwargs(model, None, args, fused_loss=fused)
    positions = []
    model.register_forward_hook(lambda m, a, out: positions.append(out.logits.shape[1]) if m.training else None)
    trainer = Trainer(**kw, train_dataset=samples())
    trainer.train()
    if trainer.is_world_process_zero():
        logs = [{k: v for k, v in h.items() if k.startswith("loss/")} for h in trainer.state.log_history if "loss" in h]
        torch.save({"weights": lora_weights(model), "logs": logs, "world": trainer.args.world_size,
                    "positions": positions}, os.path.join(out_dir, "result.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "fused", int(sys.argv[3]))
