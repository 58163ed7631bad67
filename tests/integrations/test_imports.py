"""Importing gradaccum, or its integrations package, imports none of the libraries it integrates."""

from __future__ import annotations

import json
import subprocess
import sys

LIBRARIES = (
    "transformers",
    "accelerate",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "deepspeed",
    "torchft",
)

PROBE = f"""
import json, sys
loaded = lambda: [m for m in {LIBRARIES!r} if m in sys.modules]
import gradaccum, gradaccum.integrations
gradaccum.Accumulator, gradaccum.guard, gradaccum.verify
before = loaded()
import gradaccum.integrations.accelerate  # its functions import accelerate when they run
import gradaccum.integrations.deepspeed  # and this one deepspeed
import gradaccum.integrations.torchft  # drives the caller's Manager: no torchft import at all
integration = loaded()
import accelerate
print(json.dumps([before, integration, loaded()]))
"""


def test_gradaccum_and_its_integrations_package_import_no_integrated_library() -> None:
    command = [sys.executable, "-c", PROBE]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=120)
    before, integration, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert before == [] and integration == []  # the step imports the accelerate integration's check
    assert "accelerate" in after  # the probe sees an import when there is one
