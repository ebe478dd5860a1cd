"""Ray with its token authentication, or not at all: `quantgate fanout` connects through `connect`.

An open Ray port runs anyone's code. Ray 2.60 has token authentication (RAY_AUTH_MODE=token; the token in
RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token), but a driver that sends a token also
connects to a cluster that never checks it; so the cluster itself is asked, without a token, and must refuse.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import tempfile
from pathlib import Path

from pipelines.core.errors import QuantgateError
from pipelines.core.paths import RAY_DEFAULT_TOKEN

log = logging.getLogger("pipelines.fanout")

RAY_TOKEN_PLACES = f"RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or {RAY_DEFAULT_TOKEN}"


class RayUnavailable(QuantgateError):
    """Ray is installed but no cluster could be started or reached (`quantgate repro` then runs plain `dvc repro`)."""


def token_source() -> str | None:
    """Where Ray's driver finds its token (the order Ray's loader reads them), or None: no token."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return "RAY_AUTH_TOKEN"
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or RAY_DEFAULT_TOKEN).expanduser()
    if "RAY_AUTH_TOKEN_PATH" in os.environ and not (path.is_file() and path.read_text().strip()):
        raise QuantgateError(f"RAY_AUTH_TOKEN_PATH={path}: no such file, or it is empty: point it at the cluster's token")
    return str(path) if path.is_file() and path.read_text().strip() else None


def require_token(address: str | None) -> None:
    """The driver side of Ray's token authentication, set before `import ray` (Ray reads RAY_AUTH_MODE then):
    RAY_AUTH_MODE=token, and a token. A local cluster (no address) gets a new token, written mode 0600 from the
    start (Ray's own would be written with the umask's mode)."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode.lower() != "token":
        raise QuantgateError(f"RAY_AUTH_MODE={mode}: fanout uses Ray only with token authentication (an open Ray port "
                             "runs anyone's code): set RAY_AUTH_MODE=token and the cluster's token (docs/fanout.md), "
                             "or pass --insecure")
    os.environ["RAY_AUTH_MODE"] = "token"
    if token_source() is not None:
        return
    if address is not None:
        raise QuantgateError(f"no Ray token here for the cluster at {address} ({RAY_TOKEN_PLACES}): copy the head's "
                             "token (docs/fanout.md), or pass --insecure for a cluster without token authentication")
    path = Path(RAY_DEFAULT_TOKEN).expanduser()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(secrets.token_hex(32))
    log.info("fanout: a new Ray token for the local cluster in %s (mode 0600)", path)


def refuse_open_cluster(gcs_address: str) -> None:
    """Ask the cluster's GCS for its id without a token: a cluster that answers runs anyone's code (the driver's own
    RAY_AUTH_MODE=token proves nothing of the cluster, which accepts a driver that sends a token it never checks)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(gcs_address) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(gcs_service_pb2.GetClusterIdRequest(),
                                                                              timeout=30)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                return
            raise QuantgateError(f"the Ray cluster at {gcs_address} did not say whether it requires a token "
                                 f"({err.code().name}): refused (pass --insecure to skip the check)") from None
    raise QuantgateError(f"the Ray cluster at {gcs_address} answers requests without a token (started with "
                         "RAY_AUTH_MODE=disabled?): anyone who reaches its port can run code on it. Restart it with "
                         "RAY_AUTH_MODE=token (docs/fanout.md), or pass --insecure")


def private_local_cluster() -> None:
    """Make the next local Ray start (`connect(None)`) private to this machine and this run, before `import ray`:
    Ray's single-machine mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: the node's address is 127.0.0.1, and every Ray
    server listens there only; on Linux Ray 2.60 otherwise listens on all interfaces whatever address it is given),
    token authentication with a new token held in this process's environment (Ray's processes inherit it; no file
    is written), and no RAY_ADDRESS pointing elsewhere."""
    if "ray" in sys.modules:
        raise QuantgateError("internal: Ray was imported before the local cluster's settings were made")
    if os.environ.pop("RAY_ADDRESS", None):
        log.info("repro: RAY_ADDRESS ignored: the chains run on a local Ray cluster (for a cluster: quantgate fanout)")
    os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)


def connect(address: str | None, insecure: bool = False) -> None:
    """ray.init on the cluster (None: RAY_ADDRESS, else a new local one), refused unless it requires Ray's token
    (`insecure`: not checked, said in the log)."""
    address = address or os.environ.get("RAY_ADDRESS") or None
    if not insecure:
        require_token(address)
        if address and ":" in address and not address.startswith(("ray://", "auto", "local")):
            refuse_open_cluster(address)  # a named GCS is asked before ray.init sends it the token
    try:
        import ray
    except Exception as err:  # noqa: BLE001 - a broken install raises anything on import
        raise RayUnavailable(f"Ray does not import here: {type(err).__name__}: {err}") from err
    local = {}
    if address is None:  # a new cluster of its own (Ray's None joins one an earlier `ray start` left here), no dashboard
        # its own session folder, short (Ray's socket paths must fit 107 bytes), kept like Ray's own /tmp/ray: its logs
        temp = tempfile.mkdtemp(prefix="qg-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
        log.info("fanout: a local Ray cluster; its session files and logs: %s", temp)
        local = {"include_dashboard": False, "_temp_dir": temp}
    try:
        ray.init(address=address or "local", log_to_driver=False, logging_level=logging.WARNING, **local)
    except Exception as err:  # noqa: BLE001 - Ray raises RuntimeError, ConnectionError, ... for a cluster it cannot reach
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        raise RayUnavailable(f"could not start or reach {where}: {type(err).__name__}: "
                             f"{str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}") from err
    if insecure:
        log.warning("fanout: --insecure: the Ray cluster's token authentication is not checked")
        return
    try:
        refuse_open_cluster(ray.get_runtime_context().gcs_address)
    except BaseException as err:
        ray.shutdown()
        if address is None and isinstance(err, Exception):  # our own cluster: a Ray that misbehaves, not a threat
            raise RayUnavailable(f"the local Ray cluster failed its token check: {err}") from err
        raise
