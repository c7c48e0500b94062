"""A multi-tenant training loop in miniature: one base model, a large registry of LoRA adapters (one per tenant), and
each step trains only the tenants that have requests -- in ONE mixed batch -- while tenants join and leave.

    python examples/multi_tenant.py                              # tiny random Llama on the CPU, 256 tenants, 8 a step
    python examples/multi_tenant.py --tenants 1024 --per-step 64 --steps 50 --device cuda

Each tenant's toy task is to answer any prompt with its own phrase, so every adapter learns something different and
its loss shows it; a few tenants are busy and most idle (Zipf-like requests). What the loop uses:

* ``fast_multilora.add_adapters``: the registry is created in one pass (PEFT's ``add_adapter`` loop is quadratic);
* ``fast_multilora.patch``: one mixed batch per step, each row naming its tenant's adapter;
* ``fast_multilora.AdamW``: the optimizer follows adapters added and deleted while training goes on (a
  ``torch.optim`` optimizer would need its param groups edited by hand) and steps only the adapters in the batch;
* ``fast_multilora.per_adapter_loss``: every tenant gets the gradient of training alone on its rows;
* ``fast_multilora.save_adapters``: a leaving tenant's adapter is written in PEFT's format
  (``PeftModel.from_pretrained`` loads it), and every trained one at the end.

With ``--resident K`` the registry is paged (``PatchConfig(resident_adapters=K)``): only the step's tenants, the next
step's (``fast_multilora.prefetch``, while this step runs) and K others stay on the device; every other tenant's
weights and AdamW states wait in (pinned) host memory, so the device holds the batch, not the registry. Paging takes
``torch.optim.AdamW(model.parameters())`` (``--optimizer torch``, its default here), whose param groups the loop edits
as tenants leave and join::

    python examples/multi_tenant.py --tenants 4096 --per-step 64 --resident 0 --device cuda
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

# OpenMP threads sleep instead of spinning at barriers: on a busy CPU spinning made this loop's small ops 20-40x slower
# (as in train_multi_adapter.py). Must be set before torch loads OpenMP; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import fast_multilora  # noqa: E402  (first: with a checkout root on sys.path it keeps the name `kernels` PyPI's)

# isort: split
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tenants", type=int, default=256, help="adapters in the registry")
    ap.add_argument("--per-step", type=int, default=8, help="tenants with requests in each step")
    ap.add_argument("--rows", type=int, default=2, help="rows (requests) per tenant in a step")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--churn-every", type=int, default=10, help="every so many steps one tenant leaves, one joins")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="folder for the saved adapters (default: a temporary one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resident", type=int, default=None,
                    help="page the registry: keep the step's and the next step's tenants and this many others on the "
                         "device (PatchConfig.resident_adapters); default: every adapter resident")
    ap.add_argument("--optimizer", choices=("fast", "torch"), default=None,
                    help="fast_multilora.AdamW (default) or torch.optim.AdamW(model.parameters()) (default and "
                         "required with --resident)")
    args = ap.parse_args(argv)
    if args.optimizer is None:
        args.optimizer = "torch" if args.resident is not None else "fast"
    if args.resident is not None and args.optimizer != "torch":
        ap.error("--resident pages the optimizer states of a torch.optim optimizer: use --optimizer torch")
    return args


def params_of(model, name):
    """Adapter ``name``'s parameters (what a torch optimizer holds for it)."""
    return [p for n, p in model.named_parameters() if f".{name}." in n]


def drop_from(opt, params):
    """A leaving tenant's parameters out of a torch optimizer's groups and states (``fast_multilora.AdamW`` follows
    deletions itself)."""
    gone = set(map(id, params))
    for g in opt.param_groups:
        g["params"] = [p for p in g["params"] if id(p) not in gone]
    for p in params:
        opt.state.pop(p, None)


VOCAB = 64


def tenant_batch(names, rows, seq, phrases, gen, device):
    """``rows`` requests per tenant: a random prompt, then the tenant's own phrase; labels train the phrase only."""
    ids, labels, row_names = [], [], []
    half = seq // 2
    for name in names:
        for _ in range(rows):
            x = torch.randint(0, VOCAB, (half,), generator=gen)
            y = phrases[name]
            ids.append(torch.cat([x, y]))
            lab = torch.cat([torch.full((half,), -100), y])
            labels.append(lab)
            row_names.append(name)
    return torch.stack(ids).to(device), torch.stack(labels).to(device), row_names


def base_model(seq):
    """The base (a tiny random Llama; a real service loads a pretrained one)."""
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=2 * seq))


def phrase(rnd, n):
    return torch.tensor([rnd.randrange(VOCAB) for _ in range(n)])


def requests(names, k, rnd):
    """The ``k`` tenants with requests this step: Zipf-like popularity (tenant ``i`` of the registry's order weighs
    ``1 / (i + 1)``), as in a service where a few tenants are busy and most are idle."""
    weights = [1.0 / (i + 1) for i in range(len(names))]
    picked: dict = {}
    while len(picked) < min(k, len(names)):
        picked[rnd.choices(names, weights)[0]] = None
    return list(picked)


def main(argv=None):
    args = parse(argv)
    torch.manual_seed(args.seed)
    rnd = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS)
    names = [f"tenant{i:05d}" for i in range(args.tenants)]
    model = get_peft_model(base_model(args.seq), lora, adapter_name=names[0]).to(args.device)

    t0 = time.perf_counter()
    fast_multilora.add_adapters(model, {n: lora for n in names[1:]})
    model.set_requires_grad(names)  # PEFT trains the active adapter only: train every tenant's
    print(f"registry: {len(names)} adapters created in {time.perf_counter() - t0:.2f} s")
    fast_multilora.patch(model, resident_adapters=args.resident)
    if args.optimizer == "fast":
        opt = fast_multilora.AdamW(model, lr=args.lr, weight_decay=0.0)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0,
                                fused=torch.device(args.device).type == "cuda")
    paged = args.resident is not None
    # with a torch optimizer the next step's tenants are picked one step ahead (paged: prefetched meanwhile), so a
    # paged run and a resident one follow the same requests
    ahead = args.optimizer == "torch"
    planned = None
    phrases = {n: phrase(rnd, args.seq // 2) for n in names}
    out = args.out or tempfile.mkdtemp(prefix="multi_tenant_")
    first, last, counts, trained = {}, {}, {}, set()
    next_id = args.tenants
    model.train()
    t0 = time.perf_counter()
    for step in range(args.steps):
        if args.churn_every and step and step % args.churn_every == 0:  # one tenant leaves, one joins
            leaving = rnd.choice(names[len(names) // 2 :])  # an idle tenant (the popular ones stay)
            fast_multilora.save_adapters(model, out, names=[leaving])
            if args.optimizer == "torch":
                drop_from(opt, params_of(model, leaving))
            model.delete_adapter(leaving)
            names.remove(leaving)
            trained.discard(leaving)
            joining = f"tenant{next_id:05d}"
            next_id += 1
            fast_multilora.add_adapters(model, {joining: lora})
            model.set_requires_grad([joining])
            if args.optimizer == "torch":
                opt.add_param_group({"params": params_of(model, joining)})
            names.append(joining)
            phrases[joining] = phrase(rnd, args.seq // 2)
            print(f"step {step}: {leaving} left (saved to {os.path.join(out, leaving)}), {joining} joined")
        if ahead and planned is not None and all(n in names for n in planned):
            active = planned
        else:  # (fast_multilora.AdamW; the first step; or a planned tenant left)
            active = requests(names, args.per_step, rnd)
        ids, labels, row_names = tenant_batch(active, args.rows, args.seq, phrases, gen, args.device)
        logits = model(input_ids=ids, adapter_names=row_names, use_cache=False).logits
        if ahead:
            planned = requests(names, args.per_step, rnd)
            if paged:  # the next step's tenants come to the device while this step's backward and update run
                fast_multilora.prefetch(model, planned)
        loss, per = fast_multilora.per_adapter_loss(logits, labels, row_names, return_dict=True)
        loss.backward()
        opt.step()
        opt.zero_grad()
        for n, v in per.items():
            first.setdefault(n, v)
            last[n] = v
            counts[n] = counts.get(n, 0) + 1
        trained.update(active)
    dt = time.perf_counter() - t0
    print(f"{args.steps} steps of {args.per_step} tenants x {args.rows} rows in {dt:.2f} s "
          f"({1e3 * dt / args.steps:.1f} ms a step) with {len(names)} adapters registered")
    if paged:
        pager = fast_multilora.paging._router(model).pager
        print(f"paged: {len(pager.resident())} adapters on the device after the last step, "
              f"{len(names) - len(pager.resident())} in host memory")
    busy = sorted(last, key=lambda n: -counts[n])[:5]
    for n in busy:
        print(f"  {n}: trained in {counts[n]} steps, loss {first[n]:.3f} -> {last[n]:.3f}")
    fast_multilora.save_adapters(model, out, names=sorted(trained))
    print(f"saved {len(trained)} trained adapters under {out}")
    return {"first": first, "last": last, "counts": counts, "trained": sorted(trained), "out": out,
            "names": list(names), "model": model}


if __name__ == "__main__":
    main()
