"""The doctor's sandbox row: the code probes' sandbox (core.sandbox's real probe) against what params.yaml runs in
it, and when it is not FULL, the remedy for the reason the probe gave."""

from __future__ import annotations

import sys
from pathlib import Path

from pipelines.core import sandbox
from pipelines.diagnose.check import FAIL, OK, WARN, Check
from pipelines.evaluation.standard_tasks import SANDBOXED

SYSCTL = Path("/proc/sys")  # where the kernel's user-namespace switches are read (a test points it elsewhere)
INSTALL_BUBBLEWRAP = "apt-get install bubblewrap"
OTHER_SYSTEMS = "Fedora: dnf install bubblewrap; Arch: pacman -S bubblewrap"
UNISOLATED = "or set evaluate.allow_unisolated_code: true in params.yaml (code then runs with weaker isolation)"


def code_rows(params) -> list[str]:
    """The rows of the evaluation that run model-written code: request types whose probes declare runs_code, and
    the sandboxed standard tasks (humaneval, mbpp) under an evaluated request type (evaluate.run_probes' rule)."""
    ev = params.evaluate
    rows = [d for d in ev.domains if ev.probes[d].runs_code]
    rows += [f"{d}:{t.name}" for d in ev.domains for t in ev.tasks.get(d, []) if t.name in SANDBOXED]
    return rows


def userns_restrictions(sysctl: Path | None = None) -> list[str]:
    """Kernel switches that keep unprivileged user namespaces (bubblewrap's) from being made, as `key=value`:
    Ubuntu's AppArmor restriction (23.10+), Debian's older unprivileged_userns_clone, max_user_namespaces 0."""
    sysctl = SYSCTL if sysctl is None else sysctl
    found = []
    for key, bad in (("kernel.apparmor_restrict_unprivileged_userns", "1"), ("kernel.unprivileged_userns_clone", "0"),
                     ("user.max_user_namespaces", "0")):
        try:
            value = (sysctl / key.replace(".", "/")).read_text().strip()
        except OSError:
            continue
        if value == bad:
            found.append(f"{key}={value}")
    return found


def sandbox_remedy(why: str) -> str:
    """What makes the full sandbox work, from isolation_level()'s reason."""
    if not sys.platform.startswith("linux"):
        return f"code probes need Linux (bubblewrap and namespaces are Linux-only); {UNISOLATED}"
    if "bwrap not found" in why:
        return f"{INSTALL_BUBBLEWRAP} (as root; {OTHER_SYSTEMS}), {UNISOLATED}"
    if why.startswith("not root"):
        return f"run as root (the sandbox's namespaces and its switch to uid 65534 need it), {UNISOLATED}"
    if "util-linux" in why:
        return f"apt-get install util-linux, {UNISOLATED}"
    if "python3" in why and "bwrap" not in why:
        return f"apt-get install python3 (a /usr/bin/python3 that uid 65534 can run), {UNISOLATED}"
    if "Unknown option" in why:
        return f"bubblewrap 0.8 or newer (Debian 12, Ubuntu 24.04): upgrade it ({INSTALL_BUBBLEWRAP}), {UNISOLATED}"
    restricted = userns_restrictions()
    if restricted:
        fixes = {"kernel.apparmor_restrict_unprivileged_userns=1": "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0",
                 "kernel.unprivileged_userns_clone=0": "sysctl -w kernel.unprivileged_userns_clone=1",
                 "user.max_user_namespaces=0": "sysctl -w user.max_user_namespaces=15000"}
        return (f"the kernel restricts user namespaces ({', '.join(restricted)}): "
                f"{'; '.join(fixes[r] for r in restricted)} as root (keep it with a file in /etc/sysctl.d/), "
                f"{UNISOLATED}")
    if Path("/.dockerenv").exists() or Path("/run/.containerenv").exists():
        return ("this container forbids new namespaces: start it with --privileged (or --cap-add SYS_ADMIN "
                f"--security-opt seccomp=unconfined --security-opt apparmor=unconfined), {UNISOLATED}")
    return f"see the reason; `bwrap --ro-bind / / true` as root shows bubblewrap's own error; {UNISOLATED}"


def sandbox_check(params) -> Check:
    """The sandbox's real probe (sandbox.isolation_level) against what the run does with it."""
    level, why = sandbox.isolation_level()
    label = {sandbox.FULL: "full", sandbox.NAMESPACES: "namespaces only", sandbox.WEAK: "weak"}.get(level, level)
    if level == sandbox.FULL:
        rows = code_rows(params) if params is not None else []
        return Check("sandbox", OK, f"full isolation ({level})"
                     + (f": the code probes ({', '.join(rows)}) run in it" if rows else ""))
    why_text = why or "not FULL"
    if params is None:
        return Check("sandbox", WARN, f"{label} ({level}): {why_text}", sandbox_remedy(why_text))
    rows = code_rows(params)
    if not rows:
        return Check("sandbox", OK, f"{label}: {why_text}; not needed: no request type params.yaml evaluates runs code")
    if params.evaluate.allow_unisolated_code:
        return Check("sandbox", WARN, f"{label} ({level}): {why_text}; {', '.join(rows)} run anyway because "
                                      "evaluate.allow_unisolated_code is true", sandbox_remedy(why_text))
    return Check("sandbox", FAIL, f"{label}: {why_text}; the code probes ({', '.join(rows)}) would be refused and "
                                  "their rows could not be decided (gate exit 2)", sandbox_remedy(why_text))
