"""Build the auraed host image: a machine whose PID 1 is auraed in the host role (bare metal).

Run through ``host-image/build [--out DIR]``: prints the output directory (and nothing else on stdout).
It is guest-image/mkimage.py's build with more in the root: the same kernel, initramfs and Python
(cached by the same kind of inputs hash, sharing its downloaded .debs), plus what a host needs:
runc, iproute2, the standard CNI plugins, e2fsprogs (the data disk is formatted on first boot),
busybox's udhcpc with our lease script, ``/etc/aurae/auraed.toml`` and
``/usr/lib/aurae/host.json`` (the profile PID 1 reads: the data disk, the API port, where the PKI
goes; auraed/init/host.py). The default output is ``<repo>/.work/host-image/<inputs-hash>/``.

It also holds QEMU (qemu-system-x86_64 with its TCG accelerator module, virtiofsd, the firmware
microvm and q35 load) and the guest image (guest-image/build's vmlinuz, initramfs.img and
rootfs.img, reused from its cache) at ``GUEST_IMAGE``, which the daemon's config names: VMs and vm
pods work with no configuration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import lzma
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "guest-image"))

import mkdisk  # noqa: E402 (disk.img, in this directory)
import mkimage as guest  # noqa: E402 (the guest's builder, beside this directory)

FILES = HERE / "files"
BASE = guest.REPO / ".work" / "host-image"
# Secure Boot: the owner's keys (PK, KEK, db; RSA 2048, self-signed), made by the first build and
# kept for the next ones (a machine that enrolled them boots every later image); never in git
# (.work/ is ignored). Their files are in the inputs hash: new keys, a new build. Only the
# certificates go into a build's output (secureboot/); db's key signs the unified kernel image.
KEYS = guest.REPO / ".work" / "host-image-keys"
KEY_NAMES = ("PK", "KEK", "db")

# Besides the guest's: programs a host runs, and the libraries they link.
HOST_PROGRAMS = ("runc", "iproute2", "containernetworking-plugins", "e2fsprogs", "iptables")
HOST_LIBRARIES = (
    "libbpf1", "libelf1", "libmnl0", "libselinux1", "libpcre2-8-0", "libtirpc3",
    "libgssapi-krb5-2", "libkrb5-3", "libk5crypto3", "libcom-err2", "libkrb5support0",
    "libkeyutils1", "libext2fs2", "libblkid1", "libbsd0", "libmd0", "libxtables12",
    "libnftnl11", "libnetfilter-conntrack3", "libnfnetlink0",
)  # fmt: skip
# iptables as Debian 12 sets it up (its alternatives: the nf_tables backend), which the CNI plugins
# run: bridge's ipMasq, portmap's hostPorts, firewall. xtables-nft-multi is every one of these
# names; its extensions (the matches and targets, dlopened) are all there, 2 MB.
IPTABLES_NAMES = (
    "iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore",
    "iptables-nft", "iptables-nft-save", "iptables-nft-restore",
    "ip6tables-nft", "ip6tables-nft-save", "ip6tables-nft-restore",
)  # fmt: skip
XTABLES_DIR = f"usr/lib/{guest.MULTIARCH}/xtables"
# QEMU for the guests (and vm pods) the host boots: the emulator, its TCG accelerator and virtiofsd
# (qemu-system-common; TCG is a module in Debian's build, /usr/lib/x86_64-linux-gnu/qemu), the firmware
# QEMU loads (qemu-system-data: microvm's qboot and the option ROMs that boot -kernel; seabios:
# q35's BIOS; ipxe-qemu: the ROM of q35's virtio-net-pci), and what they link.
QEMU_PROGRAMS = ("qemu-system-x86", "qemu-system-common", "qemu-system-data", "seabios", "ipxe-qemu")
QEMU_LIBRARIES = (
    "libaio1", "libcap-ng0", "libcapstone4", "libdaxctl1", "libfdt1", "libfuse3-3", "libglib2.0-0",
    "libgmp10", "libgnutls30", "libhogweed6", "libibverbs1", "libidn2-0", "libjpeg62-turbo", "libkmod2",
    "libmount1", "libndctl6", "libnettle8", "libnl-3-200", "libnl-route-3-200", "libnuma1",
    "libp11-kit0", "libpixman-1-0", "libpmem1", "libpng16-16", "librdmacm1", "libsasl2-2", "libslirp0",
    "libtasn1-6", "libudev1", "libunistring2", "liburing2", "libvdeplug2",
)  # fmt: skip
QEMU_MODULE_DIR = f"usr/lib/{guest.MULTIARCH}/qemu"
QEMU_MODULES = ("accel-tcg-x86_64.so",)  # -accel tcg; KVM is built in
# (package, path in it): what QEMU reads from its firmware path (/usr/share/qemu, /usr/share/seabios,
# /usr/lib/ipxe/qemu) for microvm (qboot; pvh.bin and linuxboot_dma.bin boot -kernel) and q35.
QEMU_FIRMWARE = (
    ("qemu-system-data", "usr/share/qemu/qboot.rom"),
    ("qemu-system-data", "usr/share/qemu/bios-microvm.bin"),
    ("qemu-system-data", "usr/share/qemu/pvh.bin"),
    ("qemu-system-data", "usr/share/qemu/linuxboot.bin"),
    ("qemu-system-data", "usr/share/qemu/linuxboot_dma.bin"),
    ("qemu-system-data", "usr/share/qemu/multiboot_dma.bin"),
    ("qemu-system-data", "usr/share/qemu/kvmvapic.bin"),
    ("seabios", "usr/share/seabios/bios-256k.bin"),
    ("seabios", "usr/share/seabios/bios.bin"),
    ("ipxe-qemu", "usr/lib/ipxe/qemu/efi-virtio.rom"),
)
# Where the guest image goes in the root, read-only; auraed.toml's guest_image names it.
GUEST_IMAGE = "/usr/lib/aurae/guest-image"
GUEST_IMAGE_FILES = ("vmlinuz", "initramfs.img", "rootfs.img", "manifest.json")
LIBRARY_PACKAGES = (*guest.LIBRARY_PACKAGES, *HOST_LIBRARIES, *QEMU_LIBRARIES)
# Not in the root: the EFI stub disk.img's unified kernel image is made of, GRUB's BIOS boot code
# and modules (host-image/mkdisk.py; grub-mkimage itself is grub-common's, from hack/setup), and
# Debian's signed UEFI chain, copied to the ESP as shipped: shim (signed by Microsoft's UEFI CA),
# its MokManager and GRUB (signed by Debian).
BOOT_PACKAGES = (
    "systemd-boot-efi", "grub-pc-bin", "shim-signed", "shim-helpers-amd64-signed", "grub-efi-amd64-signed",
)  # fmt: skip
PACKAGES = (
    *guest.PACKAGES, *HOST_PROGRAMS, *HOST_LIBRARIES, *QEMU_PROGRAMS, *QEMU_LIBRARIES, *BOOT_PACKAGES,
)  # fmt: skip
# The CNI plugins auraed's pod networking uses (auraed/cni/): the reference set a conflist names.
CNI_PLUGINS = (
    "bridge", "host-local", "loopback", "portmap", "firewall", "bandwidth", "tuning", "ptp", "static",
)  # fmt: skip
# A PC's or server's kernel: Debian's generic linux-image-amd64, whose disk controllers are modules
# (the guest's cloud kernel has no AHCI or USB at all, and NVMe built in).
KERNEL_META = "linux-image-amd64"
# Loaded by the initramfs besides the guest's (virtio): the disks a machine boots from. SATA (AHCI,
# and Intel's controllers in IDE mode), NVMe, USB sticks and disks (xHCI, EHCI, OHCI, UHCI
# controllers; usb-storage and UAS) -- sd_mod gives the SCSI-like ones their /dev/sdX -- and ext4,
# the data partition's file system (built into the cloud kernel, a module of this one).
STORAGE_MODULES = (
    "sd_mod", "ahci", "ata_piix", "nvme", "xhci_pci", "ehci_pci", "ohci_pci", "uhci_hcd",
    "usb_storage", "uas", "ext4",
)  # fmt: skip
# Loaded by the initramfs too: the common wired NICs of PCs and servers (Intel's e1000e, igb, igc,
# ixgbe, i40e, ice; Realtek's r8169; Broadcom's tg3 and bnxt_en; Mellanox/NVIDIA's mlx5_core: 1.5
# MB more gzipped for the last two), besides virtio_net. No firmware blob: Debian's firmware
# packages are in non-free-firmware, which this build's apt sources do not have (ice then runs
# its safe mode without its DDP package; mlx5's firmware is on the card).
NIC_MODULES = ("e1000e", "igb", "igc", "ixgbe", "i40e", "ice", "r8169", "tg3", "bnxt_en", "mlx5_core")
# In the root for the kernel to load on demand (busybox's modprobe, by modules.alias): what the CNI
# plugins' iptables rules need on the nf_tables backend (nft_compat runs the xt_ matches and
# targets iptables-nft does not translate; nft_chain_nat the nat table's chains) besides the
# guest's bridge, veth and nf_tables.
NETFILTER_MODULES = (
    "nf_conntrack", "nf_nat", "nft_compat", "nft_chain_nat", "nft_nat", "nft_masq", "nft_ct",
    "xt_MASQUERADE", "xt_nat", "xt_addrtype", "xt_multiport", "xt_mark", "xt_comment", "xt_conntrack",
    "xt_tcpudp",
)  # fmt: skip
# Loaded by PID 1 at boot (host.json's "modules", with their dependencies first): tun for the VMs'
# taps (nothing else loads it: no udev), KVM for their accelerator on real machines (the one that
# does not fit the CPU fails, logged).
BOOT_MODULES = ("tun", "kvm_intel", "kvm_amd")
EXTRA_MODULES = (*guest.ROOTFS_EXTRA_MODULES, *NETFILTER_MODULES, *BOOT_MODULES)

DATA_LABEL = "AURAE-DATA"  # the data disk's ext4 label; a blank disk with DATA_SERIAL gets it
DATA_SERIAL = "aurae-data"
STATE_DIR = "/var/lib/aurae"
API_PORT = 8443
PROFILE = {
    "flavour": "host",
    "data_disk": {
        "label": DATA_LABEL,
        "serial": DATA_SERIAL,
        "partname": mkdisk.DATA_NAME,
        "fstype": "ext4",
        "mount": STATE_DIR,
    },
    "api_port": API_PORT,
    "tls_dir": f"{STATE_DIR}/tls",
    "client_dir": f"{STATE_DIR}/client",
    "dhcp_script": "/usr/share/aurae/udhcpc.script",
    # /etc/cni/net.d is a link to the data disk's cni/net.d, which PID 1 makes: the pods' CNI
    # networks an operator (or a network add-on) puts there outlive a reboot, at the path every
    # CNI installer writes to.
    "state_dirs": ["cni/net.d"],
}
CNI_CONF_LINK = ("etc/cni/net.d", f"{STATE_DIR}/cni/net.d")
DAEMON_CONFIG = f"""# auraed on a machine booted from the host image (host-image/mkhost.py writes this file).
# A config disk (auraed.config_disk=<device> on the kernel command line) mounted on /etc/aurae
# replaces it. The state, the PKI among it, lives on the data disk mounted on {STATE_DIR}.
tcp_listen = "[::]:{API_PORT}"
state_dir = "{STATE_DIR}"
ca_crt = "{STATE_DIR}/tls/ca.crt"
ca_key = "{STATE_DIR}/tls/ca.key"
server_crt = "{STATE_DIR}/tls/server.crt"
server_key = "{STATE_DIR}/tls/server.key"
stop_containers_on_shutdown = true
# The guest image in the read-only root (guest-image/build's, put there by host-image/build).
guest_image = "{GUEST_IMAGE}"
"""


class HostBuild(guest.Build):
    library_packages = LIBRARY_PACKAGES
    initramfs_modules = (*guest.INITRAMFS_MODULES, *STORAGE_MODULES, *NIC_MODULES)
    rootfs_extra_modules = EXTRA_MODULES
    identity = ("host", "aurae-host")
    guest_image = ""  # the inputs hash of the guest image in the root

    def run(self, started: float) -> None:
        super().run(started)
        with self.step("vmlinux"):
            extract_vmlinux(self.work / "vmlinuz", self.work / "vmlinux")
        with self.step("disk image"):
            stub = self.trees["systemd-boot-efi"] / mkdisk.STUB
            grub = self.trees["grub-pc-bin"] / mkdisk.GRUB_DIR
            try:
                chain = mkdisk.SignedChain.from_trees(self.trees)
                signer = (KEYS / "db.key", KEYS / "db.crt")
                layout = mkdisk.make_disk(self.work, stub, grub, self.inputs.digest, chain, signer=signer)
            except mkdisk.DiskError as exc:
                raise guest.BuildError(str(exc)) from None
            certificates = self.work / "secureboot"
            certificates.mkdir()
            for name in KEY_NAMES:
                shutil.copy(KEYS / f"{name}.crt", certificates / f"{name}.crt")
                shutil.copy(KEYS / f"{name}.cer", certificates / f"{name}.cer")
        self.used_packages |= set(BOOT_PACKAGES)
        path = self.work / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["step_seconds"] = self.timings
        manifest["build_seconds"] = round(time.monotonic() - started, 1)
        manifest["files"]["disk.img"] = {"size": layout["size"], "sha256": sha256_of(self.work / "disk.img")}
        vmlinux = self.work / "vmlinux"
        manifest["files"]["vmlinux"] = {"size": vmlinux.stat().st_size, "sha256": sha256_of(vmlinux)}
        manifest["disk"] = layout
        manifest["packages_outside_root"] = {p: self.inputs.packages[p] for p in BOOT_PACKAGES}
        manifest["guest_image"] = {"path": GUEST_IMAGE, "inputs_hash": self.guest_image}
        path.write_text(json.dumps(manifest, indent=2) + "\n")
        guest.log(f"disk image (raw GPT, UEFI or BIOS; dd it to a disk): {self.out / 'disk.img'}")

    def customize(self) -> None:
        s = self.stage
        trees = self.trees
        self.replace(trees["runc"] / "usr/sbin/runc", "usr/sbin/runc")
        for name in ("ip", "ss"):
            self.replace(trees["iproute2"] / "bin" / name, f"usr/bin/{name}")
        for name in ("bridge", "tc"):
            self.replace(trees["iproute2"] / "sbin" / name, f"usr/sbin/{name}")
        shutil.copytree(trees["iproute2"] / "etc/iproute2", s / "etc/iproute2", dirs_exist_ok=True)
        for name in ("mke2fs", "e2fsck", "tune2fs", "dumpe2fs"):
            self.replace(trees["e2fsprogs"] / "sbin" / name, f"usr/sbin/{name}")
        for alias in ("mkfs.ext4", "fsck.ext4"):
            self.replace(None, f"usr/sbin/{alias}", link="mke2fs" if alias.startswith("mkfs") else "e2fsck")
        shutil.copy(trees["e2fsprogs"] / "etc/mke2fs.conf", s / "etc/mke2fs.conf")
        self.install_iptables()
        cni = s / "usr/lib/cni"
        cni.mkdir(parents=True, exist_ok=True)
        for plugin in CNI_PLUGINS:
            shutil.copy2(trees["containernetworking-plugins"] / "usr/lib/cni" / plugin, cni / plugin)
        link, target = CNI_CONF_LINK
        (s / link).parent.mkdir(parents=True, exist_ok=True)
        (s / link).symlink_to(target)
        self.used_packages |= set(HOST_PROGRAMS)
        self.install_qemu()
        self.install_guest_image()
        share = s / "usr/share/aurae"
        share.mkdir(parents=True, exist_ok=True)
        shutil.copy(FILES / "udhcpc.script", share / "udhcpc.script")
        (share / "udhcpc.script").chmod(0o755)
        (s / "etc/aurae/auraed.toml").write_text(DAEMON_CONFIG)
        modules = guest.Modules.load(self.kernel_tree / "lib/modules" / self.kernel_release)
        profile = {**PROFILE, "modules": [modules.filename(n) for n in modules.load_order(BOOT_MODULES)]}
        (s / "usr/lib/aurae/host.json").write_text(json.dumps(profile, indent=2) + "\n")
        (s / "var/lib/aurae").mkdir(parents=True, exist_ok=True)
        (s / "var/lib/aurae").chmod(0o700)
        (s / "etc/resolv.conf").write_text("")

    def install_iptables(self) -> None:
        trees = self.trees
        self.replace(trees["iptables"] / "usr/sbin/xtables-nft-multi", "usr/sbin/xtables-nft-multi")
        for name in IPTABLES_NAMES:
            self.replace(None, f"usr/sbin/{name}", link="xtables-nft-multi")
        shutil.copytree(trees["iptables"] / XTABLES_DIR, self.stage / XTABLES_DIR, symlinks=True)

    def install_qemu(self) -> None:
        trees, s = self.trees, self.stage
        self.replace(trees["qemu-system-x86"] / "usr/bin/qemu-system-x86_64", "usr/bin/qemu-system-x86_64")
        for name in QEMU_MODULES:
            self.replace(trees["qemu-system-common"] / QEMU_MODULE_DIR / name, f"{QEMU_MODULE_DIR}/{name}")
        self.replace(trees["qemu-system-common"] / "usr/lib/qemu/virtiofsd", "usr/lib/qemu/virtiofsd")
        for package, relative in QEMU_FIRMWARE:
            source = trees[package] / relative
            target = s / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_symlink():
                target.symlink_to(os.readlink(source))
            else:
                shutil.copy2(source, target)
        self.used_packages |= set(QEMU_PROGRAMS)

    def install_guest_image(self) -> None:
        """guest-image/build's output (its cache: reused when its inputs are unchanged) at GUEST_IMAGE."""
        image = guest.build(None, self.inputs.rootfs_type, False, guest.DEFAULT_BASE / "cache")
        target = self.stage / GUEST_IMAGE.lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        for name in GUEST_IMAGE_FILES:
            shutil.copy(image / name, target / name)
        self.guest_image = json.loads((image / "manifest.json").read_text())["inputs_hash"]
        self.used_packages |= {p for p in self.inputs.packages if p.endswith("-cloud-amd64")}

    def replace(self, source: Path | None, relative: str, link: str = "") -> None:
        """Put ``source`` (or a symlink to ``link``) at ``relative``, in place of busybox's applet."""
        target = self.stage / relative
        if target.is_symlink() or target.exists():
            target.unlink()
        target.parent.mkdir(parents=True, exist_ok=True)
        if link:
            target.symlink_to(link)
        else:
            assert source is not None
            shutil.copy2(source, target)


XZ_MAGIC = b"\xfd7zXZ\x00"


def extract_vmlinux(vmlinuz: Path, out: Path) -> None:
    """The kernel's ELF image out of its bzImage (the XZ stream after the decompressor): booted by
    its PVH entry point (``-kernel vmlinux`` on microvm), it skips the bzImage's own decompression,
    ~8-12 s of every boot under TCG (the cloud kernel's LZ4 took well under one)."""
    data = vmlinuz.read_bytes()
    start = data.find(XZ_MAGIC)
    if start < 0:
        raise guest.BuildError(f"{vmlinuz}: no XZ payload (not an XZ-compressed bzImage)")
    decompressor = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    elf = decompressor.decompress(data[start:])
    if not decompressor.eof or elf[:4] != b"\x7fELF" or b"Xen\x00" not in elf:
        raise guest.BuildError(f"{vmlinuz}: its payload is not an ELF kernel with a PVH (Xen) note")
    out.write_bytes(elf)


def ensure_keys(directory: Path = KEYS) -> None:
    """The Secure Boot keys, made once (``openssl``): ``<name>.key``, ``.crt`` (PEM) and ``.cer``
    (DER, what firmware set-up screens take) for each of KEY_NAMES."""
    wanted = [directory / f"{name}.{kind}" for name in KEY_NAMES for kind in ("key", "crt", "cer")]
    if all(path.is_file() for path in wanted):
        return
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    with (directory.parent / ".host-image-keys.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if all(path.is_file() for path in wanted):
            return
        guest.log(f"making Secure Boot keys in {directory} (kept for later builds)")
        for name in KEY_NAMES:
            key, crt, cer = (directory / f"{name}.{kind}" for kind in ("key", "crt", "cer"))
            for path in (key, crt, cer):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            guest.run([
                "openssl", "req", "-new", "-x509", "-newkey", "rsa:2048", "-nodes", "-sha256",
                "-days", "3650", "-subj", f"/CN=auraed host image {name}/",
                "-keyout", str(key), "-out", str(crt),
            ])  # fmt: skip
            key.chmod(0o600)
            guest.run(["openssl", "x509", "-in", str(crt), "-outform", "DER", "-out", str(cer)])


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(4 * 1024 * 1024):
            digest.update(block)
    return digest.hexdigest()


HOST = guest.Flavour("host", BASE, PACKAGES, (guest.HERE, HERE, KEYS), HostBuild, KERNEL_META)


def with_guest_kernel(flavour: guest.Flavour = HOST) -> guest.Flavour:
    """HOST with the guest image's kernel package among its packages: the guest image in the root
    changes with it (its other inputs, packages and sources, are the host's too). apt's answer is
    remembered like the guest build's own."""
    kernel, _ = guest.debian_packages(guest.DEFAULT_BASE / "cache")
    return dataclasses.replace(flavour, packages=(*flavour.packages, kernel))


if __name__ == "__main__":
    try:
        ensure_keys()
        flavour = with_guest_kernel()
    except guest.BuildError as exc:
        print(f"host-image/build: {exc}", file=sys.stderr)
        sys.exit(1)
    sys.exit(guest.main(flavour=flavour, description=__doc__.split("\n\n")[0]))
