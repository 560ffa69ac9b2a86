"""The floor plan: draftsmith.models below, draftsmith.decode and draftsmith.train on it, the
decoder standing alone, and no generic top-level names of our own."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import tiny_model_overrides

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(folder: str) -> dict[str, set[str]]:
    """file -> every module its code imports, at the top or inside a function (read from the source)."""
    import ast

    out = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
        out[str(path.relative_to(ROOT))] = names
    return out


FLOORS = {"models": ("decode", "train"), "decode": ("train",)}  # a floor never imports the ones above it


def test_no_floor_imports_the_floors_above_it():
    """models < decode, models < train, decode never imports train: in every import of every file,
    lazy ones inside functions included."""
    wrong = {}
    for floor, above in FLOORS.items():
        for path, names in imported_modules(floor).items():
            bad = sorted(n for n in names if any(n.split(".")[0] == up or n.split(".")[:2] == ["draftsmith", up]
                                                 for up in above))
            if bad:
                wrong[path] = bad
    assert not wrong, wrong
    assert "draftsmith.decode.proposers" in imported_modules("decode")["decode/build.py"]  # the scan reads imports


def test_the_decoder_imports_no_training_code():
    code = ("import sys\n"
            "import draftsmith.decode.engine, draftsmith.decode.evaluate, draftsmith.decode.proposers\n"
            "import draftsmith.decode.eagle, draftsmith.decode.draft, draftsmith.decode.lookup\n"
            "bad = sorted(m for m in sys.modules if m.startswith('draftsmith.train') or m.split('.')[0] == 'train')\n"
            "assert not bad, bad\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_an_unrelated_models_package_does_not_break_draftsmith(tmp_path, tiny_model_dir):
    """A user project with its own top-level `models`, `decode` and `train` packages first on
    sys.path: the decoder decodes and a trainer trains."""
    for name in ("models", "decode", "train"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the user project\\'s own {name}')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    code = ("import torch\n"
            "from draftsmith.decode.engine import generate\n"
            "from tests.tiny import tiny_llama\n"
            "out = generate(tiny_llama(), torch.tensor([[5, 6, 7]]), max_new_tokens=4)\n"
            "assert len(out.tokens) == 4\n"
            "print('decoded')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**env, "PYTHONPATH": f"{tmp_path}:{ROOT}"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "decoded" in proc.stdout, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, str(ROOT / "train" / "medusa.py"), *tiny_model_overrides(tiny_model_dir),
                           "data=tiny", "trainer=debug", "logger=none", f"output_dir={tmp_path / 'out'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "out" / "final" / "model.safetensors").is_file()
