"""Serve a generated model repository on this machine (CPU) with the tritonserver binary that
the `nvidia-pytriton` wheel bundles (Triton 2.51 with the Python backend).

    python -m eagle_trt.build.local_triton --repository artifacts/<name>/triton [--grpc-port 8001]

The wheel is located without importing it (its own Python API is not used). The Python
backend's stub is linked against libpython of the running interpreter's version: the
bundled stub for this version is copied into a private backend folder and LD_LIBRARY_PATH
points at this interpreter's own lib dir (else the stub picks up the system libpython and
fails).

The stub runs Python isolated (environment variables such as PYTHONPATH are ignored) and takes
its packages from the `python3` it finds on PATH, as pytriton arranges too. So the server gets
a small venv of its own first on PATH, whose site-packages point (.pth) at: numpy 1.26, this
repository, and this environment's site-packages. numpy 1.x because the 2.51 stub is built
against it: under numpy 2 the tensors it hands to Python come out wrong (a BYTES input decodes
to garbage and the stub aborts). numpy 1.26 is installed once with pip into a cache folder;
torch, onnxruntime and transformers run with it unchanged."""
from __future__ import annotations

import argparse
import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

STUB_NUMPY = "numpy==1.26.4"


class TritonUnavailable(RuntimeError):
    pass


def stub_numpy_dir() -> Path:
    """A folder holding numpy 1.x for the Python backend stub: the one `make setup` installs into
    the environment (<prefix>/triton-stub-numpy), else a cache folder filled once with pip."""
    from ..checkpoints import cache_dir
    installed = Path(sys.prefix) / "triton-stub-numpy"
    if (installed / "numpy" / "__init__.py").is_file():
        return installed
    final = cache_dir() / "triton-stub" / STUB_NUMPY.replace("==", "-")
    if (final / "numpy" / "__init__.py").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".numpy-", dir=final.parent))
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp),
                               STUB_NUMPY], capture_output=True, text=True, check=False)
        if done.returncode:
            raise TritonUnavailable(f"the Triton 2.51 Python backend stub needs numpy 1.x; 'pip install --target "
                                    f"{final} {STUB_NUMPY}' failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def bundled_tritonserver() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonUnavailable("the bundled Triton server needs nvidia-pytriton: pip install --no-deps "
                                "nvidia-pytriton==0.7.0")
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise TritonUnavailable(f"{root}: no bin/tritonserver in the nvidia-pytriton package")
    return root


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port on 127.0.0.1 that is free now, drawn below the kernel's ephemeral range: a port the
    kernel hands out for bind(0) is also what it hands to outgoing connections as their source port,
    so one of those (another test's client) could take it before the server binds it."""
    low, _ = _ephemeral_range()
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(10000, max(low, 10001))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class LocalTriton:
    """Context manager: start tritonserver on 127.0.0.1 with free ports, wait until the model
    repository is loaded, stop it (SIGTERM, then SIGKILL) on exit. `log` holds the server log."""

    def __init__(self, repository: str | Path, grpc_port: int | None = None, http_port: int | None = None,
                 startup_timeout: float = 180.0, extra_env: dict | None = None):
        self.repository = Path(repository).resolve()
        self.chosen_ports = grpc_port is None and http_port is None   # ours to draw again if taken
        self.grpc_port, self.http_port = grpc_port or free_port(), http_port or free_port()
        self.timeout, self.extra_env = startup_timeout, extra_env or {}
        self.proc: subprocess.Popen | None = None
        self.workdir: Path | None = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def log(self) -> str:
        return (self.workdir / "server.log").read_text(errors="replace") if self.workdir else ""

    def _backends(self, root: Path) -> Path:
        backends = self.workdir / "backends"
        python = backends / "python"
        python.mkdir(parents=True)
        for f in (root / "backends" / "python").iterdir():
            if f.is_file():
                shutil.copy2(f, python / f.name)
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not stub.is_file():
            raise TritonUnavailable(f"{stub}: nvidia-pytriton has no Python backend stub for Python {version}")
        shutil.copy2(stub, python / "triton_python_backend_stub")
        return backends

    def _stub_env(self) -> Path:
        """A venv (no pip) whose site-packages .pth lists numpy 1.x, the repo, then our packages."""
        import site
        import venv
        folder = self.workdir / "stub-env"
        venv.EnvBuilder(with_pip=False, symlinks=True).create(folder)
        ours = [p for p in site.getsitepackages() + [site.getusersitepackages()] if Path(p).is_dir()]
        lines = [str(stub_numpy_dir()), str(Path(__file__).resolve().parents[2])] + ours
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        (folder / "lib" / version / "site-packages" / "eagle_trt_stub.pth").write_text("\n".join(lines) + "\n")
        return folder / "bin"

    def env(self, root: Path) -> dict:
        env = dict(os.environ, **self.extra_env)
        libs = [sysconfig.get_config_var("LIBDIR"), str(root.parent.parent / "nvidia_pytriton.libs")]
        env["LD_LIBRARY_PATH"] = ":".join(p for p in libs + [env.get("LD_LIBRARY_PATH", "")] if p)
        env["PATH"] = f"{self._stub_env()}:{env.get('PATH', '')}"
        env.pop("PYTHONHOME", None)
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def __enter__(self) -> LocalTriton:
        root = bundled_tritonserver()
        redraws = 2 if self.chosen_ports else 0
        while True:
            self._start(root)
            try:
                self._wait_ready()
                return self
            except TritonUnavailable as exc:
                log = self.log
                self.__exit__(None, None, None)
                if not (redraws and "already in use" in log.lower()):
                    raise exc from None
                # another process took a drawn port between the draw and the server's bind: draw again
                redraws -= 1
                self.grpc_port, self.http_port = free_port(), free_port()
            except BaseException:   # interrupted (Ctrl-C, SIGTERM) while starting: stop it
                self.__exit__(None, None, None)
                raise

    def _start(self, root: Path) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="eagle_trt_triton_"))
        # the Python backend's shared-memory regions get a prefix of this server's own, as Triton's
        # docs ask of several servers on one machine
        shm_prefix = f"eagle_trt_{os.getpid()}_{self.grpc_port}_"
        cmd = [str(root / "bin" / "tritonserver"), f"--model-repository={self.repository}",
               f"--backend-directory={self._backends(root)}", f"--cache-directory={root / 'caches'}",
               f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
               "--http-address=127.0.0.1", f"--http-port={self.http_port}", "--grpc-address=127.0.0.1",
               f"--grpc-port={self.grpc_port}", "--allow-metrics=false", "--exit-on-error=true", "--exit-timeout-secs=10",
               "--log-verbose=0"]
        self.proc = subprocess.Popen(cmd, stdout=open(self.workdir / "server.log", "wb"), stderr=subprocess.STDOUT,
                                     env=self.env(root), start_new_session=True)

    def _wait_ready(self) -> None:
        import urllib.request
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TritonUnavailable(f"tritonserver exited with status {self.proc.returncode}:\n{self.log[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/v2/health/ready", timeout=2) as r:
                    if r.status == 200 and _listening(self.grpc_port):   # the clients speak gRPC
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TritonUnavailable(f"tritonserver not ready after {self.timeout:.0f}s:\n{self.log[-4000:]}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def death(self) -> str | None:
        """Why a started server is not running (None while it runs): its exit status (negative: the
        signal that ended it) and the end of its log; asked while it should run, why it died."""
        if self.proc is None or self.proc.poll() is None:
            return None
        return (f"tritonserver (grpc {self.grpc_port}, http {self.http_port}) exited with status "
                f"{self.proc.returncode}; its log ends:\n{self.log[-4000:]}")

    def __exit__(self, *_):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)   # its own session: the backend stubs go too
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.workdir is not None and not os.environ.get("EAGLE_TRT_KEEP_TRITON_LOG"):
            shutil.rmtree(self.workdir, ignore_errors=True)
        return False


def stop_on_sigterm() -> None:
    """SIGTERM (docker stop, systemd, kill) stops a server as Ctrl-C does: a with-block's exit then
    takes tritonserver and its backend stubs down instead of leaving them on the ports."""
    def interrupt(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle_trt.build.local_triton", description=__doc__.splitlines()[0])
    p.add_argument("--repository", required=True, help="model repository written by python -m eagle_trt.build")
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--http-port", type=int, default=8000)
    args = p.parse_args(argv)
    if not (Path(args.repository) / ".").is_dir():
        print(f"error: {args.repository}: model repository not found", file=sys.stderr)
        return 2
    stop_on_sigterm()
    try:
        with LocalTriton(args.repository, args.grpc_port, args.http_port) as server:
            print(f"serving {server.repository} on grpc {server.grpc_url}, http 127.0.0.1:{server.http_port} "
                  f"(Ctrl-C or SIGTERM stops)", file=sys.stderr)
            while server.alive():
                time.sleep(1)
            print(server.log[-4000:], file=sys.stderr)
            return 1
    except TritonUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
