#!/usr/bin/env python3
"""Runs a nox session of this repository on a machine that has only Python and pip.

    python3 dev.py -s demo      run every op and compare it with its reference
    python3 dev.py -s tests     the test tiers this machine can run

The first call installs nox (and uv, which nox uses to build the sessions' environments when it is there) into
.venv-tools/; every argument is passed to nox.
"""

import os
import subprocess
import sys
import venv

ROOT = os.path.dirname(os.path.abspath(__file__))
TOOLS = os.path.join(ROOT, ".venv-tools")
NOX = os.path.join(TOOLS, "bin", "nox")

if not os.path.exists(NOX):
    venv.create(TOOLS, with_pip=True)
    pip = [os.path.join(TOOLS, "bin", "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "nox"], check=True)
    subprocess.run([*pip, "uv"], check=False)  # optional: without it nox uses virtualenv and pip
os.execv(NOX, [NOX, "-f", os.path.join(ROOT, "noxfile.py"), *sys.argv[1:]])
