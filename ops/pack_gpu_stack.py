"""Packs, on a development machine, what the local stack and the worker need on a machine that reaches no
package registry (the GPU machine): `.gpu-stack/` in the repo root, to carry there and unpack with
`source ops/gpu_stack_env`.

    ops/pack_gpu_stack [--out .gpu-stack] [--check]

Pieces (see ../shared/notes/queue-on-a-gpu-machine.md for why each is as it is):
  jre.tar.xz            a jlinked Java runtime (the modules the broker needs, java.desktop included)
  kafka-<v>-lib.tar.xz  the broker's jars from the `ops/stack` cache, repacked: other platforms' native
                        libraries dropped from the codec jars, every jar stored uncompressed so xz sees the
                        class files (xz over deflated jars gains nothing)
  redis.tar.xz          Debian's redis-server with the shared libraries it needs beyond glibc (lib/) and
                        the rest of its ldd closure (lib-spare/: gpu_stack_env copies in only those the
                        target machine lacks, so none of them shadow the machine's own)
  wheels/               msgspec, aiokafka, cramjam, redis, async-timeout, llguidance, starlette, uvicorn,
                        python-multipart, and the GPU tests' jsonschema and openai with what they need,
                        for cp312 manylinux x86_64 (wheels/spare:
                        packaging and typing_extensions, installed only when the target lacks them)
  manifest.txt          versions and sizes
--check unpacks the result into a temporary folder and starts the broker and Redis from it (private ports
and folders), produces and consumes a record, and stops them.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JLINK_MODULES = (
    "java.base,java.logging,java.management,java.naming,java.security.jgss,java.security.sasl,java.sql,"
    "java.xml,java.desktop,jdk.unsupported,jdk.management,jdk.crypto.ec,jdk.zipfs,jdk.naming.dns"
)
NATIVE_SUFFIXES = (".so", ".dll", ".dylib", ".jnilib", ".a")
KEEP_PLATFORMS = ("linux/amd64/", "linux/x86_64/")  # compared lower-case: snappy says Linux/x86_64
# The Python packages the GPU image lacks (its torch stack brings packaging and typing_extensions, which
# aiokafka needs: those travel as spares): the worker's (msgspec, aiokafka with its codecs' cramjam, redis),
# constrained decoding's (llguidance) and the gateway's (starlette, uvicorn, python-multipart: ops/bench_batch.py runs it).
# Versions follow the project's venv when it has them.
# Then what the GPU tests import that the image lacks (ops/gpu_tests.sh: test_gateway, test_structured_output and
# test_worker_engine import jsonschema; test_batch_api the official openai client; test_fp8 and test_fp8_kv_cache
# write their FP8 checkpoints with compressed-tensors, which needs loguru), with what those need.
WHEELS = ("msgspec", "aiokafka", "cramjam", "redis", "async-timeout", "llguidance", "starlette", "uvicorn",
          "python-multipart",
          "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",
          "openai", "pydantic", "pydantic-core", "typing-inspection", "annotated-types", "jiter", "distro", "sniffio",
          "httpx2", "httpcore2", "truststore", "compressed-tensors", "loguru")
# What those need that the GPU image already holds (KINDS.md's package list): not packed.
ON_GPU_IMAGE = ("anyio", "click", "h11", "attrs", "httpx", "tqdm", "idna", "torch", "transformers", "psutil")
SPARE_WHEELS = ("packaging", "typing_extensions")
GLIBC = ("linux-vdso", "libc.so", "libm.so", "libdl.so", "libpthread.so", "librt.so", "ld-linux")
# Beside glibc, the libraries the note found missing on the GPU machine: always put in lib/.
REDIS_ALWAYS = ("libatomic.so", "liblzf.so", "libjemalloc.so")
PIP_PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                 "manylinux2014_x86_64", "manylinux1_x86_64")


def log(msg: str) -> None:
    print(f"[pack] {msg}", file=sys.stderr, flush=True)


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def tar_xz(src_dir: Path, names: list[str], dest: Path) -> None:
    """tar of `names` (relative to src_dir) piped through xz -9 (single-threaded: one block, best ratio)."""
    with open(dest, "wb") as f:
        tar = subprocess.Popen(["tar", "-C", str(src_dir), "--owner=0", "--group=0", "--sort=name", "-cf", "-",
                                *names], stdout=subprocess.PIPE)
        xz = subprocess.run(["xz", "-9", "-T1", "-c"], stdin=tar.stdout, stdout=f, check=False)
        assert tar.stdout is not None
        tar.stdout.close()
        if tar.wait() != 0 or xz.returncode != 0:
            raise SystemExit(f"packing {dest.name} failed")


# ---- Java --------------------------------------------------------------------------------------------
def pack_jre(work: Path, out: Path) -> dict[str, int]:
    jlink = shutil.which("jlink")
    if jlink is None:
        raise SystemExit("jlink not found: install a JDK 17 (Debian: apt-get install -y openjdk-17-jdk-headless)")
    version = subprocess.run([jlink, "--version"], capture_output=True, text=True).stdout.strip()
    if not version.startswith("17."):
        log(f"jlink is version {version}, not 17: the runtime will be that version")
    jre = work / "jre"
    subprocess.run([jlink, "--add-modules", JLINK_MODULES, "--strip-debug", "--no-man-pages",
                    "--no-header-files", "--output", str(jre)], check=True)
    raw = sum(p.stat().st_size for p in jre.rglob("*") if p.is_file())
    tar_xz(work, ["jre"], out / "jre.tar.xz")
    return {"raw": raw, "packed": (out / "jre.tar.xz").stat().st_size}


# ---- Kafka -------------------------------------------------------------------------------------------
def kafka_lib() -> tuple[str, Path]:
    sys.path.insert(0, str(ROOT))
    from stoker.devstack.stack import StackConfig, fetch_kafka  # standard library only

    cfg = StackConfig.from_env()
    return cfg.kafka_version, fetch_kafka(cfg)  # a no-op when the cache is complete; else Maven once


def repack_jar(src: Path, dest: Path) -> tuple[int, list[str]]:
    """Copies the jar without other platforms' native libraries, every entry stored (no deflate).
    Returns (bytes of natives dropped, names dropped)."""
    dropped: list[str] = []
    dropped_bytes = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            name = info.filename
            if name.lower().endswith(NATIVE_SUFFIXES) and not any(k in name.lower() for k in KEEP_PLATFORMS):
                dropped.append(name)
                dropped_bytes += info.file_size
                continue
            data = b"" if info.is_dir() else zin.read(info)
            new = zipfile.ZipInfo(name, date_time=info.date_time)
            new.external_attr, new.compress_type = info.external_attr, zipfile.ZIP_STORED
            zout.writestr(new, data)
    return dropped_bytes, dropped


def pack_kafka(work: Path, out: Path) -> dict[str, int | str]:
    version, lib = kafka_lib()
    dest = work / "lib"
    dest.mkdir()
    raw = dropped_total = 0
    for jar in sorted(lib.glob("*.jar")):
        raw += jar.stat().st_size
        n, names = repack_jar(jar, dest / jar.name)
        if names:
            kept = [i.filename for i in zipfile.ZipFile(dest / jar.name).infolist()
                    if i.filename.lower().endswith(NATIVE_SUFFIXES)]
            log(f"{jar.name}: dropped {len(names)} natives ({mib(n)}), kept {kept}")
        dropped_total += n
    name = f"kafka-{version}-lib.tar.xz"
    tar_xz(work, ["lib"], out / name)
    return {"version": version, "raw": raw, "natives_dropped": dropped_total, "packed": (out / name).stat().st_size,
            "file": name}


# ---- Redis -------------------------------------------------------------------------------------------
def redis_binary() -> Path:
    found = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(found).exists():
        if os.geteuid() == 0 and shutil.which("apt-get"):
            log("installing redis-server with apt-get")
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "redis-server"],
                           env=env, check=True, stdout=subprocess.DEVNULL)
        else:
            raise SystemExit("redis-server is not installed (Debian: apt-get install -y redis-server)")
    return Path(found)


def ldd(binary: Path) -> dict[str, Path]:
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    libs = {}
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
            libs[parts[0]] = Path(parts[2])
    return libs


def pack_redis(work: Path, out: Path) -> dict[str, int | str]:
    found = redis_binary()
    version = subprocess.run([str(found), "--version"], capture_output=True, text=True).stdout.split()[2]
    binary = found.resolve()  # Debian: a link to redis-check-rdb, which picks its role from argv[0]
    top = work / "redis"
    for d in ("lib", "lib-spare"):
        (top / d).mkdir(parents=True)
    shutil.copy2(binary, top / "lib" / "redis-server")  # the real binary, named redis-server
    for soname, path in ldd(binary).items():
        if soname.startswith(GLIBC):
            continue
        where = "lib" if soname.startswith(REDIS_ALWAYS) else "lib-spare"
        shutil.copy2(path, top / where / soname)  # under its soname (path may be a versioned file)
    # On PATH: a wrapper, so that only redis sees these libraries (an exported LD_LIBRARY_PATH would put
    # Debian's libatomic and friends in front of the machine's own for torch and everything else).
    wrapper = top / "redis-server"
    wrapper.write_text('#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")\n'
                       'LD_LIBRARY_PATH="$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/lib/redis-server" "$@"\n')
    wrapper.chmod(0o755)
    raw = sum(p.stat().st_size for p in top.rglob("*") if p.is_file())
    tar_xz(work, ["redis"], out / "redis.tar.xz")
    return {"version": version, "raw": raw, "packed": (out / "redis.tar.xz").stat().st_size,
            "spare_libs": " ".join(sorted(p.name for p in (top / "lib-spare").iterdir()))}


# ---- Python wheels -----------------------------------------------------------------------------------
def pinned(name: str) -> str:
    """name==version of the project's venv when it has the package (the versions the tests ran), else name."""
    # ops/bootstrap's venv path (not the script itself: it would re-point the shared venv at this checkout)
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("STOKER_CACHE") or Path.home() / ".cache" / "stoker")
    py = cache / f"venv-{key}" / "bin" / "python"
    if py.exists():
        r = subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
                           capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip():
            return f"{name}=={r.stdout.strip()}"
    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return name


def pip_download(names: list[str], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    for p in PIP_PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + names, check=True)


# The GPU machine's interpreter, for the wheels' environment markers (KINDS.md: CPython 3.12 on x86_64 Linux).
GPU_MARKER_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
                  "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
                  "platform_machine": "x86_64", "os_name": "posix", "extra": ""}


def requires(wheel: Path) -> list[str]:
    """The names a wheel's Requires-Dist lines need on the GPU machine without extras (markers evaluated by
    packaging, which pip itself vendors)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a bare interpreter: pip's copy
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(GPU_MARKER_ENV):
            continue
        out.append(req.name)
    return out


def pack_wheels(out: Path) -> dict[str, int | str]:
    wheels = out / "wheels"
    pip_download([pinned(n) for n in WHEELS], wheels)
    pip_download([pinned(n) for n in SPARE_WHEELS], wheels / "spare")
    have = {n.replace("-", "_").lower() for n in WHEELS + SPARE_WHEELS + ON_GPU_IMAGE}
    for w in sorted(wheels.glob("*.whl")):
        for req in requires(w):
            base = req.replace("-", "_").replace(".", "_").lower()
            if base not in have:
                raise SystemExit(f"{w.name} needs {req}, which is not packed: add it to WHEELS")
    files = sorted(wheels.rglob("*.whl"))
    return {"packed": sum(f.stat().st_size for f in files), "files": " ".join(f.name for f in files)}


# ---- the check ---------------------------------------------------------------------------------------
CHECK_SCRIPT = r"""
set -euo pipefail
source "$ROOT/ops/gpu_stack_env"
case "$(command -v java)" in "$GPU_STACK_DIR"/*) ;; *) echo "java is not the packed one" >&2; exit 1;; esac
case "$(command -v redis-server)" in "$GPU_STACK_DIR"/*) ;; *) echo "redis is not the packed one" >&2; exit 1;; esac
trap 'python3 -m stoker.devstack down --wipe' EXIT
python3 -m stoker.devstack up
kafka_exe=$(readlink "/proc/$(cat "$STOKER_STACK_DIR/kafka/kafka.pid")/exe")
redis_exe=$(readlink "/proc/$(cat "$STOKER_STACK_DIR/redis/redis.pid")/exe")
echo "broker runs $kafka_exe; redis runs $redis_exe"
case "$kafka_exe" in "$GPU_STACK_DIR"/*) ;; *) exit 1;; esac
case "$redis_exe" in "$GPU_STACK_DIR"/*) ;; *) exit 1;; esac
# The codecs' natives run in the broker when it validates a compressed batch; aiokafka (de)compresses with
# cramjam, packed with the wheels (the worker must read compressed records).
python3 "$ROOT/ops/pack_gpu_stack.py" --produce-consume
echo "codec natives the broker has loaded: $(grep -o -E '[^/]*(zstd|snappy|lz4)[^/]*\.so' \
    "/proc/$(cat "$STOKER_STACK_DIR/kafka/kafka.pid")/maps" | sort -u | tr '\n' ' ')"
if grep -E "UnsatisfiedLink|NoClassDefFound|ERROR" "$STOKER_STACK_DIR/logs/kafka.log" | head -5 | grep .; then
    echo "(the lines above are from the broker's log)"
fi
"""


def produce_consume() -> None:
    """Inside the check: a record with each codec through the packed broker (it decompresses each batch to
    validate it, with the codec jars' natives), consumed back; a set/get in the packed Redis."""
    import asyncio

    import redis.asyncio as aioredis
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    boot, topic = f"127.0.0.1:{os.environ['STOKER_KAFKA_PORT']}", os.environ["STOKER_JOB_TOPIC"]

    async def run() -> None:
        sent = []
        for codec in ("zstd", "lz4", "snappy", "gzip", None):
            try:
                p = AIOKafkaProducer(bootstrap_servers=boot, compression_type=codec)
            except RuntimeError as e:  # aiokafka's own codec library (cramjam) is not packed: say so, go on
                print(f"check: producer with {codec}: {e}")
                continue
            try:
                await p.start()
                await p.send_and_wait(topic, f"hello-{codec}".encode(), key=b"k")
                sent.append(f"hello-{codec}".encode())
            except Exception as e:
                print(f"check: producer with {codec}: {type(e).__name__}: {e}")
            finally:
                await p.stop()
        c = AIOKafkaConsumer(topic, bootstrap_servers=boot, auto_offset_reset="earliest", group_id="pack-check")
        await c.start()
        got: list[bytes] = []
        for _ in range(10):
            for recs in (await c.getmany(timeout_ms=2000)).values():
                got += [r.value for r in recs if r.value is not None]
            if len(got) >= len(sent):
                break
        await c.stop()
        assert sorted(got) == sorted(sent), (got, sent)
        r = aioredis.from_url(f"redis://127.0.0.1:{os.environ['STOKER_REDIS_PORT']}/0")
        await r.set("k", "v")
        assert await r.get("k") == b"v"
        await r.aclose()
        print(f"check: produced and consumed {got}; redis set/get ok")

    asyncio.run(run())


def check(out: Path, python: str) -> None:
    """Unpack with gpu_stack_env into a temporary folder, start the stack from it on private ports and
    folders (java, jars and redis-server the packed ones, checked through /proc; no Maven), produce and
    consume, set/get in Redis, stop. `python` should be a bare 3.12, like the GPU machine's."""
    tmp = Path(tempfile.mkdtemp(prefix="gpu-stack-check-"))
    (tmp / "bin").mkdir()
    (tmp / "bin" / "python3").symlink_to(python)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "STOKER_CACHE")}
    env.update(ROOT=str(ROOT), TMP=str(tmp), GPU_STACK_SRC=str(out), GPU_STACK_DIR=str(tmp / "unpacked"),
               GPU_STACK_SITE=str(tmp / "site"), PATH=f"{tmp / 'bin'}:/usr/local/bin:/usr/bin:/bin",
               STOKER_STACK_DIR=str(tmp / "stack"), STOKER_KAFKA_PORT="19392",
               STOKER_KAFKA_CONTROLLER_PORT="19393", STOKER_REDIS_PORT="19379", STOKER_JOB_TOPIC="pack-check")
    t0 = time.monotonic()
    r = subprocess.run(["bash", "-c", CHECK_SCRIPT], cwd=ROOT, env=env)
    log(f"check {'passed' if r.returncode == 0 else 'FAILED'} in {time.monotonic() - t0:.0f} s ({tmp})")
    if r.returncode != 0:
        raise SystemExit(1)
    shutil.rmtree(tmp, ignore_errors=True)


def find_python312(given: str | None) -> str:
    """The check's interpreter, as a real binary (a pyenv shim linked as python3 would run another one)."""
    candidates = [given] if given else [shutil.which("python3.12"), shutil.which("python3"),
                                        *sorted(map(str, Path.home().glob(".pyenv/versions/3.12*/bin/python3.12")))]
    for c in candidates:
        if not c:
            continue
        r = subprocess.run([c, "-c", "import sys; print(sys.version_info[:2] == (3, 12), sys.executable)"],
                           capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.startswith("True"):
            return r.stdout.split(None, 1)[1].strip()
    raise SystemExit("--check needs a Python 3.12 (the wheels are cp312): pass --python")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / ".gpu-stack")
    ap.add_argument("--check", action="store_true", help="then unpack and run the stack from it (see above)")
    ap.add_argument("--check-only", action="store_true", help="only the check, of an existing --out")
    ap.add_argument("--python", help="the check's python3 (default: python3.12 on PATH)")
    ap.add_argument("--produce-consume", action="store_true", help=argparse.SUPPRESS)  # inside the check
    args = ap.parse_args(argv)
    out: Path = args.out.resolve()
    if not args.check_only and not args.produce_consume:
        t0 = time.monotonic()
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        with tempfile.TemporaryDirectory(prefix="gpu-stack-") as tmp:
            work = Path(tmp)
            for d in ("jre", "kafka", "redis"):
                (work / d).mkdir()
            log("jlink")
            jre = pack_jre(work / "jre", out)
            log(f"jre {mib(jre['raw'])} -> {mib(jre['packed'])}; kafka jars")
            kafka = pack_kafka(work / "kafka", out)
            log(f"kafka jars {mib(int(kafka['raw']))} -> {mib(int(kafka['packed']))}; redis")
            redis = pack_redis(work / "redis", out)
            log(f"redis {mib(int(redis['raw']))} -> {mib(int(redis['packed']))}; wheels")
            wheels = pack_wheels(out)
        rows = [
            ("java runtime (jlink, xz)", jre["raw"], jre["packed"], ""),
            (f"kafka {kafka['version']} jars (natives trimmed, stored, xz)", kafka["raw"], kafka["packed"],
             f"natives dropped {mib(int(kafka['natives_dropped']))}"),
            (f"redis-server {redis['version']} + libs (xz)", redis["raw"], redis["packed"],
             f"spare libs: {redis['spare_libs']}"),
            ("python wheels", wheels["packed"], wheels["packed"], str(wheels["files"])),
        ]
        total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        buf = io.StringIO()
        buf.write(f"# .gpu-stack, packed {time.strftime('%Y-%m-%d %H:%M')} by ops/pack_gpu_stack\n")
        buf.write(f"KAFKA_VERSION={kafka['version']}\nKAFKA_ARCHIVE={kafka['file']}\n")
        for name, raw, packed, note in rows:
            buf.write(f"# {name}: {mib(int(raw))} -> {mib(int(packed))} {note}\n")
        buf.write(f"# total {mib(total)}\n")
        (out / "manifest.txt").write_text(buf.getvalue())
        print(buf.getvalue(), end="")
        print(f"total {mib(total)} ({total} bytes) in {out}, packed in {time.monotonic() - t0:.0f} s")
    if args.produce_consume:
        produce_consume()
        return 0
    if args.check or args.check_only:
        check(out, find_python312(args.python))
    return 0


if __name__ == "__main__":
    sys.exit(main())
