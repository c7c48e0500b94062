"""The demo under ``accelerate launch`` with 2 CPU processes (DDP over gloo) ends with the same adapter weights as a
one-process run on the same global batches.

Launch command: ``accelerate launch --multi_gpu --num_processes 2 ... --device cpu``. (``accelerate launch --cpu
--num_processes 2`` starts ONE process in accelerate 1.15 -- its multi-CPU mode needs mpirun -- so this test would
silently compare a run with itself; ``--multi_gpu`` uses torchrun, and without CUDA, or with the script's
``Accelerator(cpu=True)``, accelerate runs multi-CPU DDP over gloo.)

Each rank gets half of every global batch (``split_batches=True``) -- a different mix of adapters and token counts
per rank -- and computes ``fast_multilora.training.distributed_per_adapter_loss``: per-adapter token counts are
all-reduced and the loss is scaled by the world size, because DDP averages gradients over ranks. The global objective
(sum over adapters of each adapter's mean token loss over the global batch) and so every AdamW step then match the
one-process run, up to float summation order.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "train_multi_adapter.py"
ADAPTERS = ["upper", "reverse", "digits"]
# SGD (momentum) and no clipping: the update is linear in the gradient, so a wrong loss scale would show (AdamW
# normalizes gradient scale away); lora_B starts at zero, so after training it is the accumulated update itself.
FLAGS = ["--model", "tiny", "--max-steps", "4", "--global-batch-size", "10", "--no-eval", "--dropout", "0",
         "--optimizer", "sgd", "--lr", "0.5", "--max-grad-norm", "0", "--adapters", ",".join(ADAPTERS),
         "--device", "cpu", "--train-per-adapter", "40"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    return env


def _run(cmd, out, extra=()):
    res = subprocess.run(cmd + FLAGS + list(extra) + ["--output-dir", str(out)], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return res


def _adapter_weights(out):
    return {a: load_file(str(out / "adapters" / a / "adapter_model.safetensors")) for a in ADAPTERS}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "fast_adamw"])
def test_ddp_two_processes_match_one_process(tmp_path, optimizer):
    """``fast_adamw``: fast_multilora.AdamW over the adapter store; under DDP the layers take the per-parameter path
    (DDP's hooks sit on the parameters), whose gradients land in the store's gradient arena."""
    if shutil.which("accelerate") is None:
        pytest.skip("accelerate CLI not on PATH")
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ["--optimizer", optimizer] + (["--lr", "0.05"] if optimizer == "fast_adamw" else [])
    _run([sys.executable, str(DEMO)], one, extra)
    _run(["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
          "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()), str(DEMO)],
         two, extra)
    assert json.loads((two / "run.json").read_text())["processes"] == 2
    assert json.loads((one / "run.json").read_text())["processes"] == 1
    assert json.loads((two / "run.json").read_text())["store"] == (optimizer == "fast_adamw")

    w1, w2 = _adapter_weights(one), _adapter_weights(two)
    for a in ADAPTERS:
        assert w1[a].keys() == w2[a].keys() and w1[a]
        for k in w1[a]:
            if "lora_B" in k:  # the update itself: compare relative to its own size
                assert w1[a][k].abs().max() > 1e-5, f"{k} did not train"
                atol = 1e-5 * float(w1[a][k].abs().max())
            else:
                atol = 1e-6
            if optimizer == "fast_adamw":
                # AdamW moves each element by ~lr (0.05) per step whatever the gradient's scale; where a gradient is
                # near zero (lora_A's first steps: lora_B starts at zero) m / (sqrt(v) + eps) amplifies the ranks'
                # other summation order (measured: one element in 1024 at 2.3e-4); a rank stepping on its own half
                # of the batch (no all-reduce) would move many elements by ~lr
                atol = 1e-2 * 0.05
            torch.testing.assert_close(w2[a][k], w1[a][k], rtol=1e-5, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
    # and the per-step, per-adapter losses logged by both runs (global means) agree
    h1 = json.loads((one / "metrics.json").read_text())["history"]
    h2 = json.loads((two / "metrics.json").read_text())["history"]
    for s1, s2 in zip(h1, h2, strict=True):
        for a in ADAPTERS:
            assert s1["loss"][a] == pytest.approx(s2["loss"][a], rel=1e-5)


@pytest.mark.slow
def test_fsdp2_gradients_match_one_process(tmp_path):
    """FSDP2 (``torch.distributed.fsdp.fully_shard``, base and adapters sharded, only adapters trainable) on 2 CPU
    ranks: the gathered LoRA gradients equal a one-process backward of ``per_adapter_loss`` on the global batch.
    (accelerate 1.15 does not run FSDP on CPU, so this drives fully_shard directly, as accelerate's FSDP2 plugin
    does per decoder layer; ``examples/accelerate/fsdp2.yaml`` is the GPU launch config.)"""
    sys.path.insert(0, str(ROOT / "tests"))
    import fsdp2_worker
    from models import peft_model

    import fast_multilora

    got = _fsdp2_run(tmp_path, "sharded")
    assert got["sharded"] == got["params"]  # every parameter is a DTensor shard
    assert any("fsdp_ignored_params" in w for w in got["warnings"]), got["warnings"]  # the fix is named

    ref = peft_model("llama")
    fast_multilora.patch(ref, backend="torch")
    ref.train()
    ids, labels, names = fsdp2_worker.global_batch()
    out = ref(input_ids=ids, adapter_names=names)
    fast_multilora.per_adapter_loss(out.logits, labels, names).backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert set(got["grads"]) == set(want) and want
    for n, g in want.items():
        torch.testing.assert_close(got["grads"][n], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    from fast_multilora.data import adapter_param_groups, clip_grad_norm_per_adapter

    norms = clip_grad_norm_per_adapter(adapter_param_groups(ref), max_norm=1e-3)
    assert set(got["norms"]) == set(norms) == {"a0", "a1", "a2"}
    for a, v in norms.items():
        assert got["norms"][a] == pytest.approx(v, rel=1e-4), a
    # fast_multilora.AdamW over FSDP2 shards: the store holds none of them; one step equals torch's AdamW
    assert got["held"] == 0
    torch.optim.AdamW(adapter_param_groups(ref), lr=1e-2, foreach=False).step()
    want = {n: p for n, p in ref.named_parameters() if "lora_" in n}
    assert set(got["stepped"]) == set(want)
    for n, w in want.items():
        torch.testing.assert_close(got["stepped"][n], w.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def _fsdp2_run(tmp_path, mode):
    out = tmp_path / f"fsdp_{mode}.pt"
    env = _env()
    env["PYTHONPATH"] = str(ROOT / "tests") + os.pathsep + env["PYTHONPATH"]
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(ROOT / "tests" / "fsdp2_worker.py"), str(out), mode],  # (a free port: test_ddp.py)
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-5000:]
    return torch.load(out)


def test_fsdp2_store_replicates_adapters_and_reduces_them(tmp_path):
    """FSDP2 with ``ignored_params=fast_multilora.fsdp_ignored_params(model)`` on 2 CPU ranks: the base is sharded,
    every LoRA parameter stays in the adapter store (its ``.grad`` a view of the gradient arena), rank 1's differing
    adapters are replaced by rank 0's at the first forward, a backward under ``set_requires_gradient_sync(False)``
    is not reduced (the ranks' gradients differ), and after a second, synchronised one the gradients on both ranks
    equal twice a one-process backward on the global batch; one step of the user's ``torch.optim.AdamW`` then
    equals one process's."""
    sys.path.insert(0, str(ROOT / "tests"))
    import fsdp2_worker
    from models import peft_model

    import fast_multilora

    got = _fsdp2_run(tmp_path, "store")
    assert got["held"] == got["lora"] > 0 and got["views"] == got["lora"] and got["active"]
    assert got["sharded"] == got["params"] - got["lora"]  # the base sharded, the adapters not
    assert not any("per-parameter" in w for w in got["warnings"]), got["warnings"]
    assert (got["local"][0] - got["local"][1]).abs().max() > 1e-4  # no reduce under no-sync

    ref = peft_model("llama")
    fast_multilora.patch(ref, backend="torch")
    ref.train()
    ids, labels, names = fsdp2_worker.global_batch()
    out = ref(input_ids=ids, adapter_names=names)
    (2 * fast_multilora.per_adapter_loss(out.logits, labels, names)).backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    for ranks in [got, *got["others"]]:
        assert set(ranks["grads"]) == set(want) and want
        for n, g in want.items():
            torch.testing.assert_close(ranks["grads"][n], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    torch.optim.AdamW(ref.parameters(), lr=1e-2).step()
    for ranks in [got, *got["others"]]:
        for n, p in ref.named_parameters():
            if "lora_" in n:
                # each update is ~lr (1e-2) per element; where a gradient is near zero Adam's g / (|g| + eps)
                # amplifies the reduce's rounding (seen: 1.6e-6); a missing or doubled update differs by ~1e-2
                torch.testing.assert_close(ranks["stepped"][n], p.detach(), rtol=1e-5, atol=1e-4,
                                           msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("other", ["adamw_fused", "fast_adamw"])
def test_adamw_options_match_foreach(tmp_path, other):
    """The demo's ``--optimizer adamw_fused`` (``AdamW(fused=True)``) and ``fast_adamw`` (``fast_multilora.AdamW``
    over the adapter store, clipping per adapter through ``clip_grad_norm(per_adapter=True)``) end with the adapter
    weights of the default AdamW (clipping per adapter on), up to float summation order, with the same logged
    per-adapter gradient norms."""
    flags = [f for f in FLAGS]
    flags[flags.index("--optimizer") + 1] = "adamw"
    flags[flags.index("--lr") + 1] = "0.05"
    flags[flags.index("--max-grad-norm") + 1] = "0.5"
    runs, norms = {}, {}
    for opt in ("adamw", other):
        out = tmp_path / opt
        res = subprocess.run([sys.executable, str(DEMO), *flags, "--optimizer", opt, "--output-dir", str(out)],
                             cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, f"{opt}:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
        run = json.loads((out / "run.json").read_text())
        assert run["optimizer"] == "AdamW" and run["fused"] == (opt == "adamw_fused"), run
        assert run["store"] == (opt == "fast_adamw"), run
        runs[opt] = _adapter_weights(out)
        norms[opt] = [h["grad_norm"] for h in json.loads((out / "metrics.json").read_text())["history"]]
    for a in ADAPTERS:
        assert runs["adamw"][a].keys() == runs[other][a].keys() and runs["adamw"][a]
        for k, want in runs["adamw"][a].items():
            if "lora_B" in k:
                assert want.abs().max() > 1e-5, f"{k} did not train"
            # each AdamW update is ~lr (0.05) per element; the two implementations round it in another order:
            # ~1e-6 apart after 4 steps, up to ~5e-5 where a gradient is near zero (m / (sqrt(v) + eps) with
            # sqrt(v) ~ eps amplifies rounding); a missing or mis-scaled update would differ by ~lr
            torch.testing.assert_close(runs[other][a][k], want, rtol=1e-4, atol=2e-3 * 0.05,
                                       msg=lambda m, k=k: f"{k}: {m}")
    for step_a, step_b in zip(norms["adamw"], norms[other], strict=True):
        assert step_a.keys() == step_b.keys() == set(ADAPTERS)
        for a in ADAPTERS:
            assert step_b[a] == pytest.approx(step_a[a], rel=1e-4), (a, step_a, step_b)
