"""The package layout: the root folder kernels/ is ``fast_multilora.kernels``, never the top-level name ``kernels``.

PyPI has a distribution named ``kernels`` (transformers >= 5.25 installs it and imports names from it), and a
checkout's root is on ``sys.path`` whenever Python runs from it (``python -c``, ``python -m pytest``, its xdist
workers). The root folder kernels/ therefore has no ``__init__.py``: a regular package there would hide PyPI's, and
``import peft`` from the root would fail. ``fast_multilora/__init__.py`` maps a source tree's own folder as
``fast_multilora.kernels`` without an import hook. Each check runs in a fresh interpreter (cwd and path as a user's).
"""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "kernels")


def _python(code: str, cwd, *args: str) -> dict:
    """Run ``code`` as ``python -c`` in ``cwd`` (so cwd is ``sys.path[0]``), without PYTHONPATH, and return the JSON it
    prints last."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, f"python -c {code!r} in {cwd} failed:\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def _pypi_kernels_file():
    """The ``__init__.py`` of PyPI's ``kernels`` where that distribution is installed, else None."""
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None
    return os.path.realpath(dist.locate_file(os.path.join("kernels", "__init__.py")))


_FROM_ROOT = r"""
import importlib.machinery, json, os, sys
# another top-level distribution named kernels, last on the path: where PyPI's is not installed, the first regular
# package of that name past the checkout's root folder (transformers imports it too, and finds it no hub-kernels one)
sys.path.append(sys.argv[1])
import peft, transformers
finders = [repr(f) for f in sys.meta_path], [repr(h) for h in sys.path_hooks]
import fast_multilora
from fast_multilora.kernels import api
hooks_after = [repr(f) for f in sys.meta_path], [repr(h) for h in sys.path_hooks]
spec = importlib.machinery.PathFinder.find_spec("kernels", sys.path)
import kernels
print(json.dumps({"cwd_on_path": os.path.realpath(sys.path[0] or os.curdir), "hooks_added": finders != hooks_after,
                  "first_kernels": spec.origin, "kernels": getattr(kernels, "__file__", None),
                  "ours": list(fast_multilora.kernels.__path__), "api": api.__file__}))
"""


def test_a_checkout_root_imports_peft_and_transformers_with_fast_multilora(tmp_path):
    """From the checkout's root, ``import peft, transformers, fast_multilora`` works (transformers imports PyPI's
    ``kernels`` where installed), importing fast_multilora adds no import hook, and the top-level name ``kernels`` is
    the first regular package of that name on the path -- PyPI's, or a stand-in placed last -- never the root folder;
    ``fast_multilora.kernels`` is the root folder."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    assert not os.path.exists(os.path.join(KERNELS, "__init__.py")), (
        "kernels/__init__.py makes the root folder the top-level package kernels, hiding PyPI's distribution")
    got = _python(_FROM_ROOT, ROOT, str(tmp_path))
    assert got["cwd_on_path"] == os.path.realpath(ROOT)
    assert not got["hooks_added"], "import fast_multilora changed sys.meta_path or sys.path_hooks"
    first = os.path.realpath(got["first_kernels"])
    assert first == os.path.realpath(got["kernels"])
    assert first == (_pypi_kernels_file() or os.path.realpath(tmp_path / "kernels" / "__init__.py"))
    assert [os.path.realpath(p) for p in got["ours"]] == [os.path.realpath(KERNELS)]
    assert os.path.realpath(got["api"]) == os.path.realpath(os.path.join(KERNELS, "api.py"))


# One fresh interpreter from the checkout's root (each costs seconds of a core: torch, transformers, peft) for the
# checks below: ``import fast_multilora`` alone, a line on each stream after it, then ``import peft, kernels``; then,
# with the checkout's root taken off ``sys.path``, which ``fast_multilora`` and kernels/ a second source tree and a
# wheel's layout import. For each layout in turn ``fast_multilora`` is dropped from ``sys.modules``, the layout's
# folder goes first on ``sys.path`` (where ``python -c`` run from a checkout's root, or PYTHONPATH, puts it: ahead of
# the editable install's finder) and ``fast_multilora`` is imported (the second import runs the package's own code
# again, third-party modules stay cached).
_FRESH = r"""
import sys
import fast_multilora
print("@@imported", flush=True)
print("@@imported", file=sys.stderr, flush=True)
import json, os, peft, kernels
out = {"kernels": getattr(kernels, "__file__", None), "which": {}}
root = os.path.realpath(os.curdir)
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
for label, folder in zip(sys.argv[1::2], sys.argv[2::2]):
    for name in [m for m in sys.modules if m == "fast_multilora" or m.startswith("fast_multilora.")]:
        del sys.modules[name]
    sys.path.insert(0, folder)
    import fast_multilora
    from fast_multilora.kernels import api
    out["which"][label] = {"package": fast_multilora.__file__, "api": api.__file__,
                           "path": list(fast_multilora.kernels.__path__)}
    sys.path.remove(folder)
print(json.dumps(out))
"""


def _copy_sources(dst, kernels_to):
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(os.path.join(ROOT, "fast_multilora"), dst / "fast_multilora", ignore=ignore)
    shutil.copytree(KERNELS, kernels_to, ignore=ignore)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """``python -W default -c _FRESH`` from the checkout's root, no PYTHONPATH or PYTHONWARNINGS, over a second source
    tree and a wheel's layout (pyproject's package-dir: kernels/ shipped as fast_multilora/kernels/), each a copy of
    this checkout's sources: (what ``import fast_multilora`` printed on stdout and on stderr, the JSON printed last,
    the layouts' folders)."""
    tmp = tmp_path_factory.mktemp("layouts")
    tree, site = tmp / "tree", tmp / "site"
    _copy_sources(tree, tree / "kernels")
    _copy_sources(site, site / "fast_multilora" / "kernels")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "PYTHONWARNINGS")}
    out = subprocess.run([sys.executable, "-W", "default", "-c", _FRESH, "tree", str(tree), "site", str(site)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "@@imported\n" in out.stdout and "@@imported\n" in out.stderr, (out.stdout[-2000:], out.stderr[-2000:])
    return (out.stdout.split("@@imported\n")[0], out.stderr.split("@@imported\n")[0],
            json.loads(out.stdout.strip().splitlines()[-1]), {"tree": tree, "site": site})


@pytest.fixture(scope="module")
def fast_multilora_first(fresh):
    """What ``import fast_multilora`` alone printed on stdout and on stderr, and the JSON of the checks after it."""
    return fresh[:3]


@pytest.fixture(scope="module")
def layouts(fresh):
    """The second source tree's and the wheel layout's folders, and what each imported."""
    return fresh[3], fresh[2]["which"]


def test_a_checkout_root_imports_fast_multilora_then_peft(fast_multilora_first):
    """``import fast_multilora, peft`` from the checkout's root: the other order works too, and ``kernels`` there is
    PyPI's distribution where it is installed."""
    got = fast_multilora_first[2]
    pypi = _pypi_kernels_file()
    if pypi is None:
        pytest.skip("PyPI's kernels is not installed (the stand-in check of the test above covers the root folder)")
    assert os.path.realpath(got["kernels"]) == pypi


def test_a_second_checkout_imports_its_own_kernels(layouts):
    """A second source tree on the path (a worktree beside an editable install of another checkout, as in
    development and in CI's clone) imports its own ``fast_multilora`` and its own kernels/, not the installed tree's.
    """
    tree, got = layouts[0]["tree"], layouts[1]["tree"]
    assert os.path.realpath(got["package"]) == os.path.realpath(tree / "fast_multilora" / "__init__.py")
    assert os.path.realpath(got["api"]) == os.path.realpath(tree / "kernels" / "api.py")
    assert [os.path.realpath(p) for p in got["path"]] == [os.path.realpath(tree / "kernels")]


def test_the_wheel_layout_imports_its_packaged_kernels(layouts):
    """The layout pyproject's package-dir gives a wheel (kernels/ shipped as fast_multilora/kernels/) imports the
    packaged kernels, with no checkout around."""
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    assert setuptools["packages"] == ["fast_multilora", "fast_multilora.kernels"]
    assert setuptools["package-dir"] == {"fast_multilora": "fast_multilora", "fast_multilora.kernels": "kernels"}
    site, got = layouts[0]["site"], layouts[1]["site"]
    assert os.path.realpath(got["package"]) == os.path.realpath(site / "fast_multilora" / "__init__.py")
    assert os.path.realpath(got["api"]) == os.path.realpath(site / "fast_multilora" / "kernels" / "api.py")
    assert [os.path.realpath(p) for p in got["path"]] == [os.path.realpath(site / "fast_multilora" / "kernels")]


def test_importing_fast_multilora_prints_nothing(fast_multilora_first):
    """``python -W default -c "import fast_multilora"`` prints nothing: what importing peft (transformers, torchao,
    bitsandbytes) logs or warns about the dependencies' own set-up is dropped (fast_multilora._third_party), and the
    library itself warns about nothing at import."""
    assert fast_multilora_first[:2] == ("", "")
