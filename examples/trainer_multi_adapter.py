"""Several LoRA adapters trained in one mixed batch by an UNMODIFIED ``transformers.Trainer``.

    python examples/trainer_multi_adapter.py --model tiny --max-steps 20
    python examples/trainer_multi_adapter.py                     # SmolLM2-135M-Instruct (see multi_adapter_tasks.py)

``fast_multilora.trainer_kwargs(model, tokenizer, args, ...)`` returns the Trainer's keyword arguments -- no
subclass, only documented Trainer arguments:

* ``data_collator``: ``MultiAdapterCollator`` pads and emits ``adapter_names`` (one per row); the Trainer passes them
  to ``model(**batch)``, where the forward pre-hook of ``fast_multilora.patch`` routes the rows.
* ``compute_loss_func`` and a callback: ``PerAdapterLoss``, the sum over adapters of each adapter's mean token loss,
  computed from the last hidden states without full-vocabulary logits where the model allows, with the Trainer's
  scaling conventions for data parallelism, and ``loss/<adapter>`` entries in the logs.
* ``PerAdapterGradClip`` clips each adapter on its own (``--max-grad-norm``), and ``adapter_lr`` gives adapters their
  own learning rate (an optimizer with one param group per adapter).
* ``args``: a copy with ``remove_unused_columns=False`` (keeps the samples' ``adapter_name``) and ``max_grad_norm=0``
  (the Trainer's global clip would couple the adapters); set here already, so no warning.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train_multi_adapter.py

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import multi_adapter_tasks as T  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, a .gguf file or a HF model dir")
    p.add_argument("--adapters", default=",".join(T.DEFAULT_ADAPTERS))
    p.add_argument("--output-dir", default="runs/trainer_multi_adapter")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=12, help="per device")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--adapter-lr", default="", help="e.g. 'upper=4e-3,digits=2e-3'")
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="per adapter")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    args = p.parse_args(argv)
    adapters = [a for a in args.adapters.split(",") if a]
    adapter_lr = {k: float(v) for k, v in (kv.split("=") for kv in args.adapter_lr.split(",") if kv)}

    from transformers import Trainer, TrainingArguments

    import fast_multilora

    base, tok = T.load_base(args.model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = T.add_adapters(base, adapters, rank=args.rank, targets=args.targets.split(","))
    print(fast_multilora.patch(model))

    targs = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=max(1, args.max_steps // 10),
        logging_steps=5, save_strategy="no", report_to="none", remove_unused_columns=False, max_grad_norm=0.0,
        use_cpu=args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()),
        dataloader_drop_last=True, seed=0,
    )
    kwargs = fast_multilora.trainer_kwargs(model, tok, targs, adapter_lr=adapter_lr or None,
                                           max_grad_norm=args.max_grad_norm)
    trainer = Trainer(**kwargs, train_dataset=T.training_examples(tok, adapters, 400))
    trainer.train()
    model.save_pretrained(os.path.join(args.output_dir, "adapters"), selected_adapters=adapters)
    print("per-adapter losses logged:")
    for h in trainer.state.log_history:
        per = {k[5:]: v for k, v in h.items() if k.startswith("loss/")}
        if per:
            print(f"  step {h['step']:4d}  " + "  ".join(f"{a}={v:.4f}" for a, v in sorted(per.items())))

    model.eval()
    rows = T.eval_rows(adapters, 8)
    acc = T.score(rows, T.generate_mixed(model, tok, rows, T.max_answer_tokens(tok, adapters),
                                         device=model.device))
    print("accuracy after training (adapters and base, one mixed generation batch):")
    for (a, t), v in sorted(acc.items()):
        print(f"  {a:<10} {t:<8} {v:.2f}")


if __name__ == "__main__":
    main()
