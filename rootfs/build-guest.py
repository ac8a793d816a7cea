#!/usr/bin/env python3
"""Builds the Vantik guest image from rootfs/guest/image.toml and tags it in the image store.

    sudo python3 rootfs/build-guest.py [--arch x86_64|aarch64] [--config FILE] [--store DIR] [--cache DIR]

The image is a directory in the store holding the guest kernel, the initramfs of the stock image
(its /init turns a read-only ext4 root plus the sandbox's own disk into an overlay root), the
root file system `rootfs.ext4` and `manifest.json`. `<store>/<name>/<tag>` is a symbolic link to
it, swapped with one rename, so a sandbox starting during a build gets the old image or the new
one, never part of one. The previous build is kept for sandboxes that resolved it just before.

Layers are cached under <cache>/guest: the debootstrap tree (by the [debian] section and the
architecture), the image's whole tree (by the config, this script and the copied files: everything
but the kernel and the initramfs, so --tree-only builds it before they exist), and the downloads
(Debian packages, wheels, npm tarballs). A build whose inputs did not change is a no-op.

--arch (default: SANDBOX_HOST_ARCH, else this host's) builds for another architecture: the same
Debian packages, wheels and npm packages for arm64, on an x86_64 host through qemu-user-static
(binfmt_misc runs the image's arm64 programs for debootstrap's second stage and npm), into that
architecture's image store (<cache>/images-aarch64), with that architecture's stock image.

Python rather than Rust: it is a build script run by an operator, tomllib reads the config, and it
keeps the service's dependency tree free of image-building code. Needs root (debootstrap, chroot,
mounts), debootstrap, e2fsprogs and the network to Debian, PyPI and the npm registry.
"""

import argparse
import datetime
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

if sys.version_info < (3, 11):
    sys.exit("build-guest: needs Python 3.11 or later (for tomllib); this is " + sys.version.split()[0])
import tomllib  # noqa: E402
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Where Debian, Fedora and Alpine keep the host's CA bundle.
HOST_CA_BUNDLES = ["/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem"]
START = time.monotonic()


def log(msg):
    print(f"[guest-image {time.strftime('%H:%M:%S')} +{time.monotonic() - START:5.0f}s] {msg}",
          file=sys.stderr, flush=True)


def die(msg):
    log(f"error: {msg}")
    sys.exit(1)


def run(cmd, **kw):
    """Runs a command with its output passed through; dies with the command named on failure."""
    r = subprocess.run(cmd, **kw)
    if r.returncode != 0:
        die(f"`{' '.join(map(str, cmd))}` failed with status {r.returncode}")
    return r


def cache_dir():
    if os.environ.get("SANDBOX_HOST_CACHE"):
        return Path(os.environ["SANDBOX_HOST_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "sandbox-host"
    return Path.home() / ".cache" / "sandbox-host"


# Our name for an architecture (as `uname -m`), Debian's, and the wheels' platform tag.
ARCHES = {"x86_64": ("amd64", "x86_64"), "aarch64": ("arm64", "aarch64")}


def host_arch():
    m = os.uname().machine
    return "aarch64" if m in ("aarch64", "arm64") else m


def guest_arch(requested):
    """--arch, else SANDBOX_HOST_ARCH, else the host's; x86_64 or aarch64."""
    a = requested or os.environ.get("SANDBOX_HOST_ARCH") or "auto"
    a = {"auto": host_arch(), "amd64": "x86_64", "arm64": "aarch64"}.get(a, a)
    if a not in ARCHES:
        die(f"the architecture must be one of auto, x86_64, aarch64, not `{a}` (--arch or SANDBOX_HOST_ARCH)")
    return a


def ensure_binfmt(arch):
    """Lets this host run the image's programs (debootstrap's second stage, npm in the chroot):
    nothing to do natively; else qemu-user-static registered with binfmt_misc, with the F flag so
    that the interpreter works inside the chroot. Registers it when the host has not (a container,
    or a host without systemd-binfmt), from the registration qemu-user-static ships."""
    if arch == host_arch():
        return
    if arch != "aarch64":
        die(f"an {arch} image is not built on a {host_arch()} host: only aarch64 images are built for a foreign architecture")
    conf = Path("/usr/lib/binfmt.d/qemu-aarch64.conf")
    if not conf.is_file():
        log("qemu-user-static is missing: installing it")
        run(["bash", str(ROOT / "scripts" / "install-deps.sh"), "--aarch64"])
    misc = Path("/proc/sys/fs/binfmt_misc")
    if not (misc / "register").exists():
        run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(misc)])
    entry = misc / "qemu-aarch64"
    if not entry.exists():
        log("registering qemu-aarch64 with binfmt_misc (from qemu-user-static)")
        line = next((l.strip() for l in conf.read_text().splitlines()
                     if l.strip() and not l.lstrip().startswith("#")), "")
        try:
            (misc / "register").write_text(line)
        except OSError as e:
            die(f"cannot register qemu-aarch64 with binfmt_misc ({e}); on a host with systemd: "
                "systemctl restart systemd-binfmt")
    status = entry.read_text()
    if not status.startswith("enabled") or "flags: " not in status or "F" not in status.split("flags: ")[1].split()[0]:
        die(f"binfmt_misc's qemu-aarch64 is not enabled with the F flag ({status.splitlines()[:3]}); "
            "remove it (echo -1 > /proc/sys/fs/binfmt_misc/qemu-aarch64) and build again")


def digest(*parts):
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def load_config(path):
    try:
        cfg = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        die(f"cannot read the image config {path}: {e}")
    for key in ("name", "tag", "debian", "npm", "harness"):
        if key not in cfg:
            die(f"{path}: `{key}` is missing")
    for src, dst in cfg.get("files", {}).items():
        if not isinstance(dst, str) or not (ROOT / src).is_file():
            die(f"{path}: [files] `{src}` must be a file of this repository mapped to a path in the image")
    for key in ("suite", "mirror", "variant", "packages"):
        if key not in cfg["debian"]:
            die(f"{path}: `debian.{key}` is missing")
    for part in (cfg["name"], cfg["tag"]):
        if not part or part.startswith(".") or not all(c.isalnum() or c in "._-" for c in part):
            die(f"{path}: `{part}` is not a valid image name or tag (letters, digits, . _ -)")
    pkg = cfg["harness"].get("npm_package")
    if pkg not in cfg["npm"]:
        die(f"{path}: harness.npm_package `{pkg}` must be one of the [npm] packages")
    for name, version in cfg["npm"].items():
        if not version or any(c in version for c in "^~*<> |"):
            die(f"{path}: npm package {name} must have an exact version, not `{version}`")
    before = cfg.get("npm_options", {}).get("before")
    if before is not None:
        try:
            datetime.datetime.strptime(before, "%Y-%m-%dT%H:%M:%SZ")
        except (TypeError, ValueError):
            die(f"{path}: npm_options.before must be a UTC time such as 2026-11-03T00:00:00Z, not `{before}`")
    return cfg


def inside(tree, path):
    """`path` (absolute, in the image) under `tree`, refusing anything that climbs out."""
    p = Path(path)
    if not p.is_absolute() or ".." in p.parts:
        die(f"`{path}` must be an absolute path without `..`")
    return tree / p.relative_to("/")


class Mounts:
    """The kernel file systems and caches a chroot needs, unmounted whatever happens."""

    def __init__(self, tree, binds):
        self.tree, self.binds, self.done = tree, binds, []

    def __enter__(self):
        for kind, src, dst in [("proc", "proc", "proc"), ("sysfs", "sys", "sys")]:
            self._mount(["-t", kind, src], dst)
        self._mount(["--rbind", "/dev"], "dev")
        for src, dst in self.binds:
            src.mkdir(parents=True, exist_ok=True)
            self._mount(["--bind", str(src)], dst)
        return self

    def _mount(self, args, dst):
        target = self.tree / dst
        target.mkdir(parents=True, exist_ok=True)
        run(["mount", *args, str(target)])
        self.done.append(target)

    def __exit__(self, *exc):
        for target in reversed(self.done):
            subprocess.run(["umount", "-R", "-l", str(target)])
        if mounts_under(self.tree):
            die(f"mounts are left under {self.tree}; see /proc/self/mounts")


def mounts_under(path):
    """Mount points at or below `path`, deepest first."""
    prefix = str(Path(path).resolve())
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            point = line.split()[1].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return sorted(found, key=len, reverse=True)


def remove_tree(path):
    """Deletes a build directory, never through a mount (a chroot's /dev is the host's /dev)."""
    path = Path(path)
    if not path.exists():
        return
    for point in mounts_under(path):
        subprocess.run(["umount", "-l", point])
    left = mounts_under(path)
    if left:
        die(f"{left[0]} is still mounted; unmount it, then remove {path}")
    shutil.rmtree(path, ignore_errors=True)


def chroot(tree, command, env=None):
    base = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "DEBIAN_FRONTEND": "noninteractive",
    }
    base.update(env or {})
    run(["chroot", str(tree), "/bin/sh", "-c", command], env=base)


def base_prefix(arch):
    """The cached base's name before its key: `base-` on x86_64 (as before aarch64 existed, so
    that cache stays valid), `base-arm64-` on aarch64."""
    return "base-" if arch == "x86_64" else f"base-{ARCHES[arch][0]}-"


def build_base(cfg, cache, debs, arch):
    """The debootstrap tree, cached by the [debian] section and the architecture; Debian packages
    kept in `debs`."""
    deb = cfg["debian"]
    key = digest(json.dumps(deb, sort_keys=True))
    prefix = base_prefix(arch)
    base = cache / f"{prefix}{key}"
    if (base / "etc" / "debian_version").exists():
        log(f"Debian {deb['suite']} {ARCHES[arch][0]} base: cached ({base})")
        return base
    log(f"Debian {deb['suite']} {ARCHES[arch][0]} base: debootstrap {deb['variant']} with {len(deb['packages'])} packages")
    debs.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".base-", dir=cache))
    try:
        run(["debootstrap", f"--arch={ARCHES[arch][0]}", f"--variant={deb['variant']}", "--components=main",
             f"--include={','.join(deb['packages'])}", f"--cache-dir={debs}",
             deb["suite"], str(tmp), deb["mirror"]])
        shutil.rmtree(tmp / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        (tmp / "var" / "cache" / "apt" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
        # Older bases of this architecture only (a key is 16 hex digits).
        for old in cache.glob(f"{prefix}*"):
            if len(old.name) == len(prefix) + 16:
                remove_tree(old)
        tmp.rename(base)
    finally:
        remove_tree(tmp)
    return base


def fetch_wheel(spec, cache, arch):
    """Downloads (once) the pinned wheel for Linux on `arch` and returns its path."""
    # x86_64's wheels stay where they were before aarch64 existed.
    wheels = cache / "wheels" if arch == "x86_64" else cache / "wheels" / arch
    wheels.mkdir(parents=True, exist_ok=True)
    name, version = spec["name"], spec["version"]
    norm = name.replace("-", "_").lower()
    found = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(f"{norm}-{version}-")]
    if found:
        return found[0]
    log(f"downloading wheel {name}=={version}")
    run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--platform", f"manylinux_2_28_{arch}", "--platform", f"manylinux_2_17_{arch}",
         "--python-version", "3.11", "-d", str(wheels), f"{name}=={version}"])
    found = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(f"{norm}-{version}-")]
    if not found:
        die(f"pip downloaded no wheel for {name}=={version}")
    return found[0]


def unpack_wheel(wheel, rules, tree):
    """Copies the members a rule names (a file, or every member under a `dir/` prefix)."""
    with zipfile.ZipFile(wheel) as z:
        members = z.infolist()
        for rule in rules:
            src, dst = rule["from"], rule["to"]
            picked = [m for m in members
                      if (m.filename.startswith(src) if src.endswith("/") else m.filename == src)]
            if not picked:
                die(f"{wheel.name} has no `{src}`")
            for m in picked:
                if m.is_dir():
                    continue
                rel = m.filename[len(src):] if src.endswith("/") else ""
                out = inside(tree, dst + rel if src.endswith("/") else dst)
                out.parent.mkdir(parents=True, exist_ok=True)
                with z.open(m) as fin, open(out, "wb") as fout:
                    shutil.copyfileobj(fin, fout)
                mode = (m.external_attr >> 16) & 0o777
                os.chmod(out, 0o755 if mode & 0o111 else 0o644)


def make_ext4(tree, out, label):
    """An ext4 image of `tree`, sized to its contents plus room for the metadata."""
    used = int(subprocess.run(["du", "-s", "--block-size=1M", str(tree)], capture_output=True,
                              text=True, check=True).stdout.split()[0])
    size = used + used // 8 + 128
    with open(out, "wb") as f:
        f.truncate(size << 20)
    # No journal (the base is only ever mounted read-only); no reserved blocks.
    run(["mkfs.ext4", "-q", "-F", "-L", label, "-m", "0", "-O", "^has_journal",
         "-E", "lazy_itable_init=0,nodiscard", "-d", str(tree), str(out)])
    run(["e2fsck", "-f", "-n", str(out)], stdout=subprocess.DEVNULL)
    return size


def tree_key(config_bytes, file_bytes, arch):
    """What decides the image's tree: the config, this script, the copied files, the arch."""
    return digest(config_bytes, Path(__file__).read_bytes(), arch, *file_bytes)


def build_tree(cfg, config_path, files, file_bytes, cache, downloads, arch):
    """The image's root file system as a directory, cached in the layer cache by tree_key: the
    Debian base, the wheels, links and files, the npm packages and the [run] commands. It needs
    neither the kernel nor the stock image, so bin/test builds it (--tree-only) while the kernel
    compiles. One build per layer cache and architecture at a time: a second waits for it.
    Returns the layer and its lock, held until the caller has copied the layer (a build of
    another config removes older layers)."""
    key = tree_key(config_path.read_bytes(), file_bytes, arch)
    prefix = f"tree-{ARCHES[arch][0]}-"
    layer = cache / f"{prefix}{key}"
    lock = open(cache / f".{prefix}lock", "w")
    if not try_lock(lock):
        log(f"waiting for another build of the {ARCHES[arch][0]} tree in {cache}")
        fcntl.flock(lock, fcntl.LOCK_EX)
    if (layer / ".complete").exists():
        log(f"the image's tree: cached ({layer})")
        return layer, lock
    # Only a build that runs the image's programs needs them runnable (a cached build does not).
    ensure_binfmt(arch)
    for stale in cache.glob(f".{prefix}tmp-*"):
        log(f"removing {stale.name}, left by an interrupted build")
        remove_tree(stale)
    work = Path(tempfile.mkdtemp(prefix=f".{prefix}tmp-", dir=cache))
    try:
        base = build_base(cfg, cache, downloads / "debs", arch)
        tree = work / "tree"
        log("copying the base")
        run(["cp", "-a", "--reflink=auto", str(base), str(tree)])

        for spec in cfg.get("wheels", []):
            wheel = fetch_wheel(spec, downloads, arch)
            log(f"unpacking {wheel.name}")
            unpack_wheel(wheel, spec["unpack"], tree)
        for link_path, target in cfg.get("links", {}).items():
            p = inside(tree, link_path)
            p.parent.mkdir(parents=True, exist_ok=True)
            if p.is_symlink() or p.exists():
                p.unlink()
            p.symlink_to(target)
        for (src, dst), data in zip(files, file_bytes):
            p = inside(tree, dst)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            os.chmod(p, (ROOT / src).stat().st_mode & 0o777)

        shutil.copy("/etc/resolv.conf", tree / "etc" / "resolv.conf")
        # Downloads inside the image trust what this host trusts (a TLS-inspecting proxy's CA
        # included); the bundle is removed before the image is sealed.
        host_ca = next((p for p in HOST_CA_BUNDLES if Path(p).is_file()), None)
        build_env = {"npm_config_cache": "/var/cache/npm-build", "npm_config_update_notifier": "false"}
        if host_ca:
            shutil.copy(host_ca, tree / "tmp" / "build-host-ca.pem")
            build_env["NODE_EXTRA_CA_CERTS"] = "/tmp/build-host-ca.pem"
        npm_cache = downloads / "npm"
        with Mounts(tree, [(npm_cache, "var/cache/npm-build")]):
            pkgs = " ".join(f"'{n}@{v}'" for n, v in cfg["npm"].items())
            log(f"npm install -g {pkgs}")
            allow = cfg.get("npm_options", {}).get("allow_scripts", [])
            allow_arg = f"--allow-scripts={','.join(allow)}" if allow else ""
            before = cfg.get("npm_options", {}).get("before")
            before_arg = f"--before={before}" if before else ""
            chroot(tree, f"npm install -g --no-audit --no-fund --loglevel=warn {allow_arg} {before_arg} {pkgs}",
                   build_env)
            commands = cfg.get("run", {}).get("commands", [])
            for i, command in enumerate(commands):
                log(f"run [{i + 1}/{len(commands)}]: {command}")
                chroot(tree, command, build_env)
        (tree / "var" / "cache" / "npm-build").rmdir()
        (tree / "etc" / "resolv.conf").unlink()

        harness_pkg = cfg["harness"]["npm_package"]
        harness_version = cfg["npm"][harness_pkg]
        installed = json.loads((tree / "usr/local/lib/node_modules" / harness_pkg / "package.json").read_text())
        if installed.get("version") != harness_version:
            die(f"{harness_pkg} installed as {installed.get('version')}, not {harness_version}")
        vantik = tree / "opt" / "vantik"
        vantik.mkdir(parents=True, exist_ok=True)
        (vantik / "pi-version").write_text(harness_version + "\n")
        for junk in ["var/lib/apt/lists", "var/cache/apt", "var/log", "tmp", "root/.npm"]:
            p = tree / junk
            if p.exists():
                shutil.rmtree(p)
                p.mkdir(mode=0o1777 if junk == "tmp" else 0o755)
        os.chmod(tree / "tmp", 0o1777)
        # Older trees of this architecture only (a key is 16 hex digits).
        for old in cache.glob(f"{prefix}*"):
            if len(old.name) == len(prefix) + 16 and old != layer:
                remove_tree(old)
        remove_tree(layer)
        (tree / ".complete").touch()
        tree.rename(layer)
    finally:
        remove_tree(work)
    return layer, lock


def try_lock(f):
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def stock_image(arch):
    env = dict(os.environ, SANDBOX_HOST_ARCH=arch)
    r = subprocess.run(["bash", str(ROOT / "rootfs" / "build-stock.sh")], capture_output=True,
                       text=True, env=env)
    sys.stderr.write(r.stderr)
    if r.returncode != 0:
        die("building the stock image (kernel, agent, initramfs) failed")
    d = Path(r.stdout.strip()).resolve()
    return d, json.loads((d / "manifest.json").read_text())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", help="x86_64 or aarch64 (default: SANDBOX_HOST_ARCH, else this host's)")
    ap.add_argument("--config", type=Path, default=ROOT / "rootfs" / "guest" / "image.toml")
    ap.add_argument("--store", type=Path, help="image store (default: SANDBOX_HOST_IMAGE_DIR, else "
                    "<cache>/images for this host's architecture and <cache>/images-<arch> for another)")
    ap.add_argument("--cache", type=Path, help="layer cache (default: <cache>/guest)")
    ap.add_argument("--download-cache", type=Path,
                    help="where Debian packages, wheels and npm tarballs are kept (default: the layer cache)")
    ap.add_argument("--tree-only", action="store_true",
                    help="build (or find) only the image's tree in the layer cache: no kernel or stock "
                    "image needed, nothing tagged (bin/test runs it while the kernel compiles)")
    args = ap.parse_args()

    if sys.platform != "linux":
        die("the guest image is built on Linux (debootstrap and ext4); build it on the Linux host that runs sandbox-host")
    if os.geteuid() != 0:
        die("run as root: debootstrap, chroot and the mounts it makes need it "
            "(sudo python3 rootfs/build-guest.py)")
    for tool, pkg in [("debootstrap", "debootstrap"), ("mkfs.ext4", "e2fsprogs"), ("chroot", "coreutils")]:
        if not shutil.which(tool):
            log(f"{tool} is missing: installing the build dependencies")
            run(["bash", str(ROOT / "scripts" / "install-deps.sh")])
            if not shutil.which(tool):
                die(f"{tool} is still missing; install Debian's {pkg}")

    arch = guest_arch(args.arch)
    cfg = load_config(args.config)
    name, tag = cfg["name"], cfg["tag"]
    default_store = cache_dir() / ("images" if arch == host_arch() else f"images-{arch}")
    store = args.store or Path(os.environ.get("SANDBOX_HOST_IMAGE_DIR") or default_store)
    cache = args.cache or cache_dir() / "guest"
    downloads = args.download_cache or cache
    cache.mkdir(parents=True, exist_ok=True)
    store.mkdir(parents=True, exist_ok=True)

    files = sorted(cfg.get("files", {}).items())
    file_bytes = [(ROOT / src).read_bytes() for src, _ in files]
    if args.tree_only:
        print(build_tree(cfg, args.config, files, file_bytes, cache, downloads, arch)[0])
        return
    # One build per image and store at a time; the lock goes with the process.
    lock = open(store / f".build-{name}.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        die(f"another build of {name} into {store} is running; wait for it to finish")
    # A build killed earlier may have left its work directory (and mounts) behind.
    for stale in store.glob(f".tmp-{name}-*"):
        log(f"removing {stale.name}, left by an interrupted build")
        remove_tree(stale)
    stock_dir, stock = stock_image(arch)
    if stock.get("arch", "x86_64") != arch:
        die(f"the stock image {stock_dir} is {stock.get('arch', 'x86_64')}, not {arch}")
    key = digest(args.config.read_bytes(), Path(__file__).read_bytes(), stock["key"], *file_bytes)
    build = f".{name}-{tag}-{key}"
    link = store / name / tag
    current = os.readlink(link) if link.is_symlink() else None
    if current == f"../{build}" and (store / build / "manifest.json").exists():
        log(f"cached: {link} (nothing changed)")
        print(link)
        return

    tree_layer, tree_lock = build_tree(cfg, args.config, files, file_bytes, cache, downloads, arch)
    harness_pkg = cfg["harness"]["npm_package"]
    harness_version = cfg["npm"][harness_pkg]
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=store))
    try:
        tree = work / "tree"
        log("copying the image's tree")
        run(["cp", "-a", "--reflink=auto", str(tree_layer), str(tree)])
        tree_lock.close()
        (tree / ".complete").unlink()
        record = {
            "name": name, "tag": tag, "key": key, "arch": arch,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "debian": cfg["debian"]["suite"],
            "harness": {"package": harness_pkg, "version": harness_version},
            "npm": cfg["npm"],
            "wheels": {w["name"]: w["version"] for w in cfg.get("wheels", [])},
            "agent_version": stock.get("agent_version"),
        }
        (tree / "opt" / "vantik" / "image.json").write_text(json.dumps(record, indent=2) + "\n")

        log("making rootfs.ext4")
        size = make_ext4(tree, work / "rootfs.ext4", name[:16])
        remove_tree(tree)
        kernel = stock["kernel"]
        for f in [kernel, "initramfs.cpio"]:
            shutil.copy(stock_dir / f, work / f)
        manifest = {
            "name": f"{name}:{tag}", "arch": arch, "kind": "disk", "kernel": kernel,
            "initrd": "initramfs.cpio", "rootfs": "rootfs.ext4",
            "agent_version": stock.get("agent_version"), "harness_version": harness_version,
            "key": key, "built_at": record["built_at"],
        }
        (work / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        os.chmod(work, 0o755)

        final = store / build
        if final.exists():
            shutil.rmtree(final)
        work.rename(final)
        (store / name).mkdir(exist_ok=True)
        previous = os.readlink(link) if link.is_symlink() else None
        tmp_link = store / name / f".{tag}.{os.getpid()}"
        tmp_link.symlink_to(f"../{build}")
        os.replace(tmp_link, link)
        # Keep the build just replaced (a sandbox may have resolved it a moment ago); drop older ones.
        keep = {build, Path(previous).name if previous else None}
        for old in store.glob(f".{name}-{tag}-*"):
            if old.name not in keep:
                shutil.rmtree(old, ignore_errors=True)
        log(f"{name}:{tag} -> {final} (rootfs.ext4 {size} MiB, "
            f"{os.stat(final / 'rootfs.ext4').st_blocks * 512 >> 20} MiB on disk)")
        print(link)
    finally:
        remove_tree(work)


if __name__ == "__main__":
    # SIGTERM and SIGHUP unwind like Ctrl-C, so the mounts are undone and the work removed.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(130))
    main()
