"""The private PostgreSQL cluster scripts/mlflow_server.py keeps MLflow's runs and users in (DIR/pg), and the
process and secret-file helpers both halves use.

Debian's binaries (/usr/lib/postgresql/<version>/bin); TCP on 127.0.0.1 only; the superuser's password goes to
initdb in a file that is mode 0600 from its first byte. PostgreSQL refuses to run as root: run as root, the
cluster runs as the `postgres` system user Debian's package creates.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PG_ROOT = Path("/usr/lib/postgresql")
PG_USER = "postgres"  # the system user Debian's postgresql package creates


class Refused(Exception):
    """What went wrong, in one line for the user."""


def pg_bin() -> Path:
    """Debian's newest PostgreSQL binaries (/usr/lib/postgresql/<version>/bin)."""
    found = sorted((p for p in PG_ROOT.glob("*/bin") if (p / "initdb").is_file() and (p / "pg_ctl").is_file()),
                   key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    if not found:
        raise Refused(f"PostgreSQL is not installed (no {PG_ROOT}/<version>/bin/initdb): apt-get install postgresql")
    return found[-1]


def as_cluster_owner() -> list[str]:
    """The command prefix that runs PostgreSQL's tools as a user it accepts (never root)."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam(PG_USER)
    except KeyError:
        raise Refused(f"running as root, but there is no {PG_USER!r} system user to run PostgreSQL as "
                      "(apt-get install postgresql creates it)") from None
    runuser = shutil.which("runuser")
    if runuser is None:
        raise Refused("running as root, but `runuser` (util-linux) is missing: PostgreSQL refuses to run as root")
    return [runuser, "-u", PG_USER, "--"]


def chown_to_cluster_owner(path: Path) -> None:
    if os.geteuid() == 0:
        entry = pwd.getpwnam(PG_USER)
        os.chown(path, entry.pw_uid, entry.pw_gid)


def run(cmd: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if out.returncode != 0:
        detail = (out.stderr or out.stdout).strip().splitlines()
        raise Refused(f"{what} failed (exit {out.returncode}): {detail[-1] if detail else 'no output'}")
    return out


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def write_private(path: Path, text: str) -> None:
    """A secret file, readable by its owner only from its first byte (created 0600, then renamed into place)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(text)
    os.replace(tmp, path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie is gone for our purposes
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def postmaster_pid(data: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int((data / "postmaster.pid").read_text().splitlines()[0])
    return None


def init_cluster(bin_dir: Path, root: Path, creds: dict) -> bool:
    """initdb DIR/pg unless a cluster is already there; True when it was made now."""
    data = root / "pg"
    if (data / "PG_VERSION").is_file():
        return False
    if data.exists() and any(data.iterdir()):
        raise Refused(f"{data} exists, is not empty and holds no PostgreSQL cluster: remove it or choose another --dir")
    data.mkdir(mode=0o700, exist_ok=True)
    chown_to_cluster_owner(data)
    prefix = as_cluster_owner()
    if prefix and subprocess.run([*prefix, "test", "-w", str(data)], capture_output=True).returncode != 0:
        raise Refused(f"the {PG_USER} user cannot write {data}: a folder above it is not searchable by other users "
                      "(chmod o+x it, or choose a --dir elsewhere, e.g. under /srv)")
    pwfile = root / "pg.pwfile"  # read by initdb, then removed
    write_private(pwfile, creds["superuser_password"] + "\n")
    chown_to_cluster_owner(pwfile)
    try:
        run([*prefix, str(bin_dir / "initdb"), "-D", str(data), "-U", PG_USER, f"--pwfile={pwfile}",
             "--auth-local=scram-sha-256", "--auth-host=scram-sha-256", "--encoding=UTF8", "--no-instructions"],
            "initdb")
    finally:
        pwfile.unlink(missing_ok=True)
    return True


def start_postgres(bin_dir: Path, root: Path, pg_port: int) -> int:
    data = root / "pg"
    if alive(postmaster_pid(data)):
        raise Refused(f"PostgreSQL already runs on {data} (pid {postmaster_pid(data)}): `stop --dir {root}` first")
    if not port_free(pg_port):
        raise Refused(f"--pg-port {pg_port} is busy on 127.0.0.1: choose another")
    log = root / "postgres.log"
    log.touch()
    chown_to_cluster_owner(log)
    # TCP on 127.0.0.1 only; the Unix socket in the cluster's own folder (not /var/run/postgresql)
    options = f"-c listen_addresses=127.0.0.1 -p {pg_port} -c unix_socket_directories={data}"
    run([*as_cluster_owner(), str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "60",
         "start"], f"PostgreSQL start (see {log})")
    return postmaster_pid(data) or 0


def ensure_database(pg_port: int, creds: dict) -> None:
    """The mlflow role and the databases it owns, runs and users (psycopg, as the superuser over 127.0.0.1)."""
    try:
        import psycopg
        from psycopg import sql
    except ImportError:
        raise Refused("the psycopg driver MLflow needs for PostgreSQL is missing: "
                      "pip install -c constraints.txt -e . (psycopg[binary])") from None
    try:
        conn = psycopg.connect(host="127.0.0.1", port=pg_port, user=creds["superuser"],
                               password=creds["superuser_password"], dbname="postgres", connect_timeout=10)
    except psycopg.Error as err:
        raise Refused(f"could not connect to PostgreSQL on 127.0.0.1:{pg_port} as {creds['superuser']}: "
                      f"{str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__}") from None
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (creds["role"],))
            if cur.fetchone() is None:
                cur.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                    sql.Identifier(creds["role"]), sql.Literal(creds["password"])))
            for database in (creds["database"], creds["auth_database"]):
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,))
                if cur.fetchone() is None:
                    cur.execute(sql.SQL("CREATE DATABASE {} OWNER {} ENCODING 'UTF8'").format(
                        sql.Identifier(database), sql.Identifier(creds["role"])))
    finally:
        conn.close()


def stop_postgres(bin_dir: Path | None, root: Path) -> None:
    data = root / "pg"
    pid = postmaster_pid(data)
    if not alive(pid):
        return
    if bin_dir is not None:
        subprocess.run([*as_cluster_owner(), str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "60",
                        "stop"], capture_output=True, text=True)
    if alive(pid):  # pg_ctl gone or stuck: the postmaster stops its children on SIGINT (fast shutdown)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)
        wait_gone(lambda: not alive(pid), 30)


def wait_gone(done, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if done():
            return True
        time.sleep(0.2)
    return done()
