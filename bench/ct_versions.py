"""Which compressed-tensors releases can read each preset sq writes: a schema scan across versions.

    .venv/bin/python bench/ct_versions.py OUT_DIR...        # sq outputs, one per preset (e.g. sq.ptq --algo rtn)

For each release in ``VERSIONS`` (wheels fetched with ``pip download --no-deps`` into
``bench/_work/ct/``, unpacked, imported one per subprocess in front of sq's venv):

- ``config``: ``QuantizationConfig.model_validate`` of the output's ``quantization_config`` succeeds (a
  release that rejects a field or a strategy sq writes cannot even start reading the checkpoint);
- ``format``: the output's ``format`` is a member of that release's ``CompressionFormat`` (a release
  without it has no compressor for the tensors);
- ``packed zero point`` (asymmetric ``pack-quantized`` only): the release packs zero points along the
  output dimension, as sq (and compressed-tensors 0.20) write them -- releases before that read an
  unpacked ``[out, groups]`` zero point, the wrong shape.

A preset's oldest readable release is the first one passing all three.  This is a necessary condition
checked on the library's own schema, not a forward pass: the releases actually run on sq's outputs are
0.17.0 (vLLM 0.32, tests/test_serving.py) and 0.20.1 (transformers, tests/test_presets.py).  Prints one
markdown table; docs/output.md holds it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / "_work" / "ct"
VERSIONS = ["0.5.0", "0.6.0", "0.7.1", "0.8.1", "0.9.0", "0.9.2", "0.9.3", "0.9.4", "0.10.2", "0.11.0", "0.12.2", "0.13.0", "0.14.0.1",
            "0.15.0.1", "0.16.0", "0.17.0", "0.18.0", "0.19.0", "0.20.1"]

PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import QuantizationConfig
import compressed_tensors.compressors as compressors
from pathlib import Path
# zero points packed along the output dimension: "packed_dim=0" in the release's pack-quantized compressor
packs_zp = any("packed_dim=0" in f.read_text() for f in Path(compressors.__file__).parent.rglob("*.py"))
out = {}
for d in sys.argv[2:]:
    qc = json.loads((Path(d) / "config.json").read_text())["quantization_config"]
    try:
        QuantizationConfig.model_validate(qc)
        config = True
    except Exception:
        config = False
    fmt = qc.get("format")
    asym = any((g.get("weights") or {}).get("symmetric") is False for g in qc["config_groups"].values())
    out[d] = {"config": config, "format": fmt in {f.value for f in CompressionFormat},
              "zero_point": (not asym) or fmt != "pack-quantized" or packs_zp}
print(json.dumps(out))
"""


def unpacked(version: str) -> Path:
    """The release's files under bench/_work/ct/<version> (downloaded once)."""
    target = WORK / version
    if (target / "compressed_tensors").is_dir():
        return target
    wheels = WORK / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"compressed-tensors=={version}",
                    "-d", str(wheels)], check=True)
    (wheel,) = wheels.glob(f"compressed_tensors-{version}-*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
    return target


def main(argv: list[str]) -> int:
    outputs = [str(Path(a).resolve()) for a in argv]
    if not outputs:
        print(__doc__)
        return 2
    passing: dict[str, list[str]] = {d: [] for d in outputs}
    for version in VERSIONS:
        proc = subprocess.run([sys.executable, "-c", PROBE, str(unpacked(version)), *outputs],
                              capture_output=True, text=True)
        if proc.returncode:
            print(f"{version}: import failed: {proc.stderr.strip().splitlines()[-1]}", file=sys.stderr)
            continue
        for d, checks in json.loads(proc.stdout).items():
            if all(checks.values()):
                passing[d].append(version)
    print(f"| preset (format) | releases of {VERSIONS[0]}..{VERSIONS[-1]} whose schema reads it |")
    print("|---|---|")
    for d in outputs:
        qc = json.loads((Path(d) / "config.json").read_text())["quantization_config"]
        print(f"| `{Path(d).name}` ({qc.get('format')}) | {_ranges(passing[d])} |")
    return 0


def _ranges(versions: list[str]) -> str:
    """'0.13.0 onwards', or the runs of consecutive scanned releases that pass."""
    if not versions:
        return "none"
    runs, run = [], [versions[0]]
    for v in versions[1:]:
        if VERSIONS.index(v) == VERSIONS.index(run[-1]) + 1:
            run.append(v)
        else:
            runs.append(run)
            run = [v]
    runs.append(run)
    text = [f"{r[0]} onwards" if r[-1] == VERSIONS[-1] else (r[0] if len(r) == 1 else f"{r[0]}-{r[-1]}") for r in runs]
    return ", ".join(text)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
