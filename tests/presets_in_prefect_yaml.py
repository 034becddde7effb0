"""prefect.yaml with each deployment's `parameters.config` block regenerated from its preset, configs/<name>.yaml,
verbatim (comments included). tests/test_deployment.py checks that prefect.yaml equals it; after editing a preset:

    python tests/presets_in_prefect_yaml.py      # rewrites prefect.yaml
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG_INDENT = " " * 6  # the preset's lines under `parameters:` / `config:` of a deployment


def regenerated(text: str) -> str:
    """`text` (prefect.yaml) with every deployment's config block replaced by its preset file."""
    lines = text.splitlines()
    out, name, i = [], None, 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        if match := re.match(r"^- name: (\S+)$", line):
            name = match.group(1)
        i += 1
        if line == "    config:" and name is not None:
            while i < len(lines) and (lines[i].startswith(CONFIG_INDENT) or not lines[i].strip()):
                i += 1  # the old block
            preset = (ROOT / "configs" / f"{name}.yaml").read_text().rstrip("\n").splitlines()
            out += [CONFIG_INDENT + row if row.strip() else "" for row in preset]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    path = ROOT / "prefect.yaml"
    path.write_text(regenerated(path.read_text()))
    sys.exit(0)
