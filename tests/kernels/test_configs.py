"""``kernels.configs.block_config`` against the block tables it replaced (a frozen copy of the Python tuples the
launchers read before the tables became JSON), over a grid of widths, dtypes, rank tiles and targets; plus its
errors for unknown ops, unknown targets and malformed files."""

import json
import math

import pytest
import torch
from fast_multilora.kernels import configs

_INF = math.inf
# ---- frozen copy of the old tables: (target -> rows) with rows (bound, *fields) ----
SHRINK = {"gpu": [(32, 64, 32, 256, 4, 3), (64, 64, 64, 128, 4, 4), (_INF, 64, 128, 128, 4, 3)],
          "interpreter": [(_INF, 16, 32, 32, 1, 1)]}
SHRINK_MANY = {"gpu": {"chunked": (32, 32, 256, 4, 3), "sgemm": (64, 32, 128, 4, 3)},
               "interpreter": {"chunked": (16, 32, 16, 1, 1), "sgemm": (16, 32, 16, 1, 1)}}
SHRINK_DROPOUT = {"gpu": [(32, 32, 32, 128, 4, 4), (_INF, 32, 128, 128, 8, 3)],
                  "interpreter": [(_INF, 16, 32, 32, 1, 1)]}
SHRINK_DROPOUT_STORE = {"gpu": [(32, 32, 32, 64, 4, 3), (_INF, 32, 128, 128, 8, 3)],
                        "interpreter": [(_INF, 16, 32, 32, 1, 1)]}
EXPAND = {"gpu": [(_INF, 64, 128, 64, 4, 1, 4)], "interpreter": [(_INF, 16, 64, 16, 1, 1, 2)]}
EXPAND_WRITE = {"gpu": [(_INF, 64, 128, 64, 8, 1, 4)], "interpreter": [(_INF, 16, 64, 16, 1, 1, 2)]}
LOOP_MIN_TILES = {"gpu": 2048, "interpreter": 0}
EXPAND_BWD = {"gpu": {
    16: (((1024, 256, 128, 8, True), (4096, 256, 64, 8, True), (_INF, 128, 64, 4, True)), (64, 64, 8, True)),
    32: (((_INF, 256, 64, 8, True),), (64, 32, 8, False)),
    64: (((_INF, 128, 64, 8, False),), (32, 32, 8, False)),
    128: (((_INF, 64, 64, 8, False),), (32, 16, 8, False)),
    256: (((_INF, 32, 64, 8, False),), (16, 16, 8, False)),
    512: (((_INF, 16, 32, 8, False),), (16, 16, 8, False)),
}, "interpreter": {r: (((_INF, 16, 64, 1, r <= 32),), (16, 64, 1, r <= 32)) for r in (16, 32, 64, 128, 256, 512)}}
SHRINK_BWD = {"gpu": {16: ((32, 128, 8, 3), (32, 64, 8, 3)), 32: ((64, 64, 8, 3), (32, 32, 8, 3)),
                      64: ((64, 64, 8, 3), (16, 32, 8, 3)), 128: ((64, 32, 8, 3), (16, 32, 8, 3))},
              "interpreter": {16: ((16, 64, 1, 1),) * 2, 32: ((16, 64, 1, 1),) * 2}}
SHRINK_BWD_DA = {"gpu": {16: ((32, 256, 4, 2), (32, 64, 8, 1)), 32: ((64, 128, 4, 3), (32, 32, 8, 1)),
                         64: ((64, 64, 4, 3), (16, 32, 8, 1)), 128: ((64, 32, 8, 2), (16, 32, 8, 1))},
                 "interpreter": {16: ((16, 64, 1, 1),) * 2, 32: ((16, 64, 1, 1),) * 2}}
SHRINK_R16 = {"none": ((_INF, 32, 256, 8, 3),), "redrawn": ((4096, 32, 128, 8, 3), (_INF, 32, 128, 4, 2)),
              "stored": ((4096, 32, 256, 4, 3), (_INF, 32, 128, 4, 3))}
DECODE = {"gpu": [(16, 1, 256, 512, 4, 1), (32, 1, 128, 128, 4, 1), (64, 1, 64, 64, 4, 1), (_INF, 1, 64, 32, 8, 1)],
          "interpreter": [(_INF, 16, 32, 32, 1, 1)]}
# ----

TARGETS = [("h200", "gpu"), ("default", "gpu"), ("interpreter", "interpreter")]
WIDTHS = [1, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 100, 128, 129, 256, 512, 1000, 1023, 1024, 1025, 2048, 4095,
          4096, 4097, 5632, 8192, 100000]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
F5 = ("BLOCK_S", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def _pick(rows, n):
    return next(row[1:] for row in rows if n <= row[0])


def _get(cfg, fields):
    return tuple(cfg[f] for f in fields)


@pytest.mark.parametrize("target,old", TARGETS)
def test_forward_rows_match_the_old_tables(target, old):
    for width in WIDTHS:
        for op, table in (("shrink", SHRINK), ("shrink_dropout", SHRINK_DROPOUT),
                          ("shrink_dropout_store", SHRINK_DROPOUT_STORE)):
            got = configs.block_config(op, width=width, target=target)
            assert _get(got, F5) == _pick(table[old], width), (op, width)
        for family in ("sgemm", "chunked"):
            got = configs.block_config("shrink_many", width=width, family=family, target=target)
            assert _get(got, F5) == SHRINK_MANY[old][family]
        for op, table in (("expand_add", EXPAND), ("expand_write", EXPAND_WRITE)):
            got = configs.block_config(op, width=width, target=target)
            assert _get(got, ("BLOCK_S", "BLOCK_N", "BLOCK_R", "num_warps", "num_stages", "N_TILES")) == \
                _pick(table[old], width), (op, width)
    assert configs.block_config("expand_loop", target=target)["min_tiles"] == LOOP_MIN_TILES[old]
    for block_r in (16, 32, 64, 128, 256, 512, 1024):
        assert _get(configs.block_config("decode", width=block_r, target=target), F5) == _pick(DECODE[old], block_r)


@pytest.mark.parametrize("target,old", TARGETS)
def test_backward_rows_match_the_old_tables(target, old):
    for dtype in DTYPES:
        wide = dtype.itemsize >= 4
        for rank_tile, (rows16, wide_row) in EXPAND_BWD[old].items():
            for width in WIDTHS:
                got = configs.block_config("expand_bwd", width=width, dtype=dtype, rank_tile=rank_tile, target=target)
                want = wide_row if wide else _pick(rows16, width)
                assert _get(got, ("BLOCK_S", "BLOCK_N", "num_warps", "fused")) == want, (rank_tile, width, dtype)
        for op, table in (("shrink_bwd", SHRINK_BWD), ("shrink_bwd_da", SHRINK_BWD_DA)):
            for rank_tile, entries in table[old].items():
                got = configs.block_config(op, dtype=dtype, rank_tile=rank_tile, target=target)
                assert _get(got, ("BLOCK_S", "BLOCK_K", "num_warps", "num_stages")) == entries[wide], (op, rank_tile)
    if old == "gpu":
        for mode, rows in SHRINK_R16.items():
            for K in WIDTHS:
                got = configs.block_config("shrink_bwd_r16", width=K, mode=mode, target=target)
                assert _get(got, ("BLOCK_S", "BLOCK_K", "num_warps", "num_stages")) == _pick(rows, K), (mode, K)
    else:  # the interpreter never takes the r16 rows (the launcher's guard)
        assert not configs.has_op("shrink_bwd_r16", target)


def test_launchers_pick_the_old_tables_rows():
    """The launchers' own helpers, on both targets (the GPU's chosen from CPU by forcing the forward's target)."""
    from fast_multilora.kernels import backward as kb
    from fast_multilora.kernels import forward as kf

    for mode, rows in SHRINK_R16.items():
        for K in (2048, 4096, 5632):
            assert kb._shrink_r16_tile(mode, K, "h200") == _pick(rows, K)
    assert kf._config_target(torch.device("cpu")) == "interpreter"  # the tests run under TRITON_INTERPRET=1
    assert configs.target_for("cpu", interpret=False) == "default"


def test_device_names_pick_their_files(monkeypatch):
    monkeypatch.setattr(configs.torch.cuda, "is_available", lambda: True)
    for name, want in (("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200"), ("NVIDIA A100-SXM4-80GB", "default"),
                       ("Tesla T4", "default")):
        monkeypatch.setattr(configs.torch.cuda, "get_device_name", lambda device=None, n=name: n)
        configs._gpu_target.cache_clear()
        assert configs.target_for("cuda:0", interpret=False) == want, name
    configs._gpu_target.cache_clear()


def test_every_shipped_file_loads_and_covers_every_width():
    stems = sorted(p.stem for p in configs.CONFIG_DIR.glob("*.json"))
    assert {"default", "h200", "interpreter"} <= set(stems)
    for stem in stems:
        for op, rows in configs.load(stem).items():
            assert rows, (stem, op)


def test_unknown_op_and_target_raise_naming_them():
    with pytest.raises(configs.ConfigError, match="unknown op 'shrinkk'"):
        configs.block_config("shrinkk", width=16, target="h200")
    with pytest.raises(configs.ConfigError, match=r"nope\.json: no block-size file for target 'nope'"):
        configs.block_config("shrink", width=16, target="nope")
    with pytest.raises(configs.ConfigError, match=r"interpreter\.json: ops\.shrink_bwd_r16"):
        configs.block_config("shrink_bwd_r16", width=16, mode="none", target="interpreter")
    with pytest.raises(configs.ConfigError, match=r"interpreter\.json: ops\.shrink_bwd_r16"):
        configs.rows("shrink_bwd_r16", "interpreter")
    with pytest.raises(configs.ConfigError, match=r"h200\.json: ops\.expand_bwd: no row for .*rank_tile=1024"):
        configs.block_config("expand_bwd", width=16, dtype=torch.bfloat16, rank_tile=1024, target="h200")


def _with_file(tmp_path, monkeypatch, data):
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    configs.load.cache_clear()
    configs._select.cache_clear()
    (tmp_path / "bad.json").write_text(data if isinstance(data, str) else json.dumps(data))


ROW = {"BLOCK_S": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 1, "num_stages": 1}


@pytest.mark.parametrize("data,match", [
    ("{not json", r"bad\.json: not valid JSON"),
    ({"ops": {"shrink": [dict(ROW, BLOCK_K=0)]}}, r"bad\.json: ops\.shrink\[0\]: BLOCK_K must be a positive integer"),
    ({"ops": {"shrink": [{k: v for k, v in ROW.items() if k != "num_warps"}]}},
     r"bad\.json: ops\.shrink\[0\]: missing field 'num_warps'"),
    ({"ops": {"shrink": [dict(ROW, BLOCK_M=16)]}}, r"bad\.json: ops\.shrink\[0\]: unknown field\(s\) \['BLOCK_M'\]"),
    ({"ops": {"shrink": [dict(ROW, dtypes=["bf16"])]}}, r"bad\.json: ops\.shrink\[0\]: dtypes must be"),
    ({"ops": {"shrink": [[64, 32, 256, 4, 3]]}}, r"bad\.json: ops\.shrink\[0\]: a row must be an object"),
    ({"ops": {"shrink": []}}, r"bad\.json: ops\.shrink: expected a non-empty list"),
    ({"ops": {"shrnk": [ROW]}}, r"bad\.json: ops\.shrnk: unknown op"),
    ({"ops": {"shrink": [dict(ROW, max_width=32)]}}, r"bad\.json: ops\.shrink: no row for width=64"),
    ({"opps": {}}, r"bad\.json: top level: unknown key"),
    ({"base": "bad", "ops": {}}, r"bad\.json: base: a file cannot be its own base"),
])
def test_malformed_files_raise_naming_file_and_key(tmp_path, monkeypatch, data, match):
    _with_file(tmp_path, monkeypatch, data)
    try:
        with pytest.raises(configs.ConfigError, match=match):
            configs.block_config("shrink", width=64, target="bad")
    finally:
        configs.load.cache_clear()
        configs._select.cache_clear()


def test_override_replaces_rows_within_the_block():
    before = dict(configs.block_config("decode", width=16, target="h200"))
    with configs.override("decode", [dict(before, BLOCK_N=32)], target="h200"):
        assert configs.block_config("decode", width=16, target="h200")["BLOCK_N"] == 32
    assert dict(configs.block_config("decode", width=16, target="h200")) == before
