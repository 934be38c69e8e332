"""Regenerate (or, with ``--check``, verify) every Python module built from ``protos/openengine/v1``.

Two generators run over the same eight files in one protoc call each (``openengine.proto`` alone
emits no messages):

* betterproto2 typed messages with grpclib client stubs and server bases -> ``protos/openengine_bp``
  (package ``openengine_bp``), used for the Control service and everything that is not the hot path;
* protobuf upb ``_pb2`` modules plus grpclib stubs -> ``protos/openengine/v1`` (package
  ``openengine.v1``, the import path protoc and TensorRT-LLM's own bindings use), used for
  ``Inference.Generate`` where decode cost matters (~1 us vs ~85 us per message).

``--check`` regenerates into a scratch folder and fails listing every file that would change, so
CI catches an edited .proto without regenerated code, or hand edits to generated code.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROTOS = Path(__file__).resolve().parent
PROTO_FILES = sorted((PROTOS / "openengine" / "v1").glob("*.proto"))
BP_DIR = PROTOS / "openengine_bp"
PB_DIR = PROTOS / "openengine" / "v1"
PB_INIT = '"""upb messages and grpclib stubs generated from the OpenEngine v0.1.0 protos (protos/generate.py)."""\n'


def _protoc(cwd: Path, *args: str) -> None:
    # cwd matters: betterproto2 skips package __init__ files that already exist relative to it.
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I", str(PROTOS), *args, *map(str, PROTO_FILES)]
    subprocess.run(cmd, check=True, cwd=cwd, stdout=subprocess.DEVNULL)


def generate_into(out: Path) -> None:
    """Write both generated trees below ``out`` (``out/openengine_bp`` and ``out/openengine/v1``)."""
    bp = out / "openengine_bp"
    pb = out / "pb"
    bp.mkdir(parents=True)
    pb.mkdir()
    _protoc(
        out,
        f"--python_betterproto2_out={bp}",
        "--python_betterproto2_opt=client_generation=async,server_generation=async",
    )
    _protoc(out, f"--python_out={pb}", f"--pyi_out={pb}", f"--grpclib_python_out={pb}")
    target = out / "openengine" / "v1"
    target.mkdir(parents=True)
    for f in sorted((pb / "openengine" / "v1").iterdir()):
        shutil.move(str(f), target / f.name)
    shutil.rmtree(pb)
    (out / "openengine" / "__init__.py").write_text(PB_INIT)
    (target / "__init__.py").write_text(PB_INIT)
    (target / "py.typed").write_text("")


def _generated_files(root: Path) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for sub in ("openengine_bp", "openengine"):
        for f in sorted((root / sub).rglob("*")):
            if f.is_file() and f.suffix != ".proto" and "__pycache__" not in f.parts:
                files[str(f.relative_to(root))] = f
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if regenerating would change any file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = Path(tmp)
        generate_into(fresh_root)
        fresh = _generated_files(fresh_root)
        current = _generated_files(PROTOS) if BP_DIR.exists() else {}
        changed = sorted(
            name
            for name in fresh.keys() | current.keys()
            if name not in fresh or name not in current or not filecmp.cmp(fresh[name], current[name], shallow=False)
        )
        if args.check:
            if changed:
                print("generated protobuf code is out of date; run `python protos/generate.py`:", file=sys.stderr)
                for name in changed:
                    print(f"  {name}", file=sys.stderr)
                return 1
            print(f"protos: {len(fresh)} generated files up to date")
            return 0
        for name in changed:
            if name not in fresh:
                current[name].unlink()
                continue
            dest = PROTOS / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(fresh[name], dest)
        print(f"protos: {len(changed)} generated files written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
