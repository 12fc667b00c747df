"""The host image's ``disk.img``: a raw GPT disk to write to a machine's disk and boot (UEFI or BIOS).

Made from the build's own outputs, without root, loop devices or mounts (host-image/mkhost.py calls
:func:`make_disk` at the end of a build):

1. UEFI, the removable-media path ``\\EFI\\BOOT\\BOOTX64.EFI``: Debian's shim (shim-signed's
   ``shimx64.efi``, signed by Microsoft's third-party UEFI CA, in most stock machines' db) with
   Debian's signed GRUB (grub-efi-amd64-signed's ``grubx64.efi``) and shim's MokManager
   (shim-helpers-amd64-signed's ``mmx64.efi``) beside it: the chain Debian's own installer boots
   by. GRUB's built-in prefix is ``/EFI/debian``; :data:`EFI_GRUB_CFG` there boots
   ``/aurae/vmlinuz`` (Debian's kernel, Debian-signed: shim verifies it for GRUB) and
   ``/aurae/initramfs.img`` (not verified) with :data:`CMDLINE`. Nothing of it is built here: the
   signed files are copied as Debian ships them.
2. ``\\EFI\\aurae\\aurae.efi``: a Unified Kernel Image -- systemd-boot-efi's
   ``linuxx64.efi.stub`` (the .deb the build fetches like the others) with ``vmlinuz``,
   ``initramfs.img``, the kernel command line (:data:`CMDLINE`) and an os-release added as PE
   sections by ``objcopy`` (binutils), signed with the owner's db key: for a machine that enrolled
   the owner's keys (and not Microsoft's), booted by a boot entry of its own.
3. GRUB for legacy BIOS (grub-pc-bin's modules, the .deb the build fetches; ``grub-mkimage`` from
   grub-common): ``core.img`` with every module it needs built in, its prefix ``(,gpt1)/grub`` (the
   ESP of the disk the BIOS booted), and ``grub.cfg`` booting ``/aurae/vmlinuz`` and
   ``/aurae/initramfs.img`` from the ESP with the same command line (:data:`CMDLINE`).
4. the ESP: a FAT32 image made by ``mkfs.fat`` (dosfstools) on a plain file, filled by mtools'
   ``mmd``/``mcopy``.
5. the disk: a sparse file, partitioned by ``sgdisk`` (gdisk), the ESP and ``rootfs.img`` written at
   their partitions' offsets. The third partition, GPT name ``aurae-data``, stays all zeros: the
   first boot formats it (auraed/init/datadisk.py) because it is blank, never otherwise. GRUB's
   ``boot.img`` goes into the protective MBR's boot code and ``core.img`` into the BIOS boot
   partition (GPT type EF02, ``aurae-bios``, in the MiB before the ESP), patched as grub-bios-setup
   patches them: where core.img starts, where the rest of it is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

MIB = 1024 * 1024
SECTOR = 512
DISK_MIB = 1024  # the whole image; the data partition takes what the others leave
ESP_MIB = 64
ROOT_ALIGN_MIB = 16  # the root partition: rootfs.img rounded up to this
ESP_NAME = "aurae-esp"
ROOT_NAME = "aurae-root"
DATA_NAME = "aurae-data"
BIOS_NAME = "aurae-bios"
ESP_TYPE = "ef00"  # EFI system partition
ROOT_TYPE = "8304"  # Linux x86-64 root (the Discoverable Partitions Specification's)
DATA_TYPE = "8300"  # Linux filesystem
BIOS_TYPE = "ef02"  # BIOS boot partition: GRUB's core.img, no file system
# The BIOS boot partition fills the gap between the GPT's entries and the ESP's first MiB; the
# other partitions keep the offsets they had before it. 1007 KiB: core.img is ~170 KiB.
BIOS_FIRST, BIOS_LAST = 34, 2047
READ_ONLY_ATTRIBUTE = 60  # GPT attribute bit: read-only
# The serial console last: it is /dev/console, where PID 1's status screen and the first boot's
# client configuration go (a server's console: IPMI/BMC serial-over-LAN); kernel messages go to both.
# With Secure Boot off, a boot entry's own options replace this line (systemd-stub's rule).
CMDLINE = f"console=tty0 console=ttyS0,115200 auraed.root=PARTLABEL={ROOT_NAME} auraed.rootwait=30"
STUB = "usr/lib/systemd/boot/efi/linuxx64.efi.stub"
# Debian's signed UEFI boot chain, as its packages ship it (package, path in it): shim signed by
# Microsoft's UEFI CA 2011 (shim-signed), its MokManager and Debian's GRUB signed by Debian's CA,
# whose certificate is built into shim (shim-helpers-amd64-signed, grub-efi-amd64-signed).
SHIM = ("shim-signed", "usr/lib/shim/shimx64.efi.signed")
MOK_MANAGER = ("shim-helpers-amd64-signed", "usr/lib/shim/mmx64.efi.signed")
GRUB_EFI = ("grub-efi-amd64-signed", "usr/lib/grub/x86_64-efi-signed/grubx64.efi.signed")
# On the ESP: shim at the removable-media path, which every UEFI firmware runs from a disk with no
# boot entry; shim runs grubx64.efi (and mmx64.efi, when a MOK request or a refused signature asks
# for it) from its own directory; GRUB reads grub.cfg from its built-in prefix, /EFI/debian on the
# partition it was loaded from. The owner-signed UKI at a path of its own, for a boot entry.
EFI_BOOT = "EFI/BOOT/BOOTX64.EFI"
EFI_GRUB = "EFI/BOOT/grubx64.efi"
EFI_MOK_MANAGER = "EFI/BOOT/mmx64.efi"
EFI_GRUB_CFG_PATH = "EFI/debian/grub.cfg"
UKI_PATH = "EFI/aurae/aurae.efi"
GRUB_DIR = "usr/lib/grub/i386-pc"  # in grub-pc-bin's tree
# Built into core.img: reading the GPT disk and the ESP, the serial console, normal mode (grub.cfg)
# and the Linux loader. Nothing is loaded from the ESP but grub.cfg, the kernel and the initramfs.
GRUB_MODULES = (
    "biosdisk", "part_gpt", "fat", "normal", "configfile", "echo", "serial", "terminal", "linux",
    "boot", "test",
)  # fmt: skip
GRUB_PREFIX = "(,gpt1)/grub"  # partition 1 of the disk the BIOS booted from: the ESP
GRUB_CFG = """# auraed host image {digest}: legacy BIOS boot (host-image/mkdisk.py writes this file).
# UEFI firmware runs \\EFI\\BOOT\\BOOTX64.EFI (shim, then Debian's GRUB: \\EFI\\debian\\grub.cfg) instead.
serial --unit=0 --speed=115200
terminal_input console serial
terminal_output console serial
set timeout=0
menuentry "auraed host image {digest}" {{
	echo "aurae-grub: booting /aurae/vmlinuz (BIOS)"
	linux /aurae/vmlinuz {cmdline}
	initrd /aurae/initramfs.img
}}
"""
# Debian's signed GRUB (UEFI, under shim). No serial or terminal commands: GRUB writes to the
# firmware's console, which the firmware itself copies to the serial port when it redirects its
# console there (OVMF does; a server's BIOS does with serial-over-LAN on); GRUB's own driver on the
# same UART would write every line twice. With Secure Boot on, ``linux`` has shim verify the kernel
# (Debian's, signed by Debian's CA, which shim trusts); the initramfs and this file are not verified.
EFI_GRUB_CFG = """# auraed host image {digest}: UEFI boot by shim and Debian's signed GRUB (written by
# host-image/mkdisk.py at GRUB's built-in prefix, /EFI/debian). Legacy BIOS: /grub/grub.cfg.
set timeout=0
menuentry "auraed host image {digest}" {{
	echo "aurae-grub: booting /aurae/vmlinuz (UEFI, shim)"
	linux /aurae/vmlinuz {cmdline}
	initrd /aurae/initramfs.img
}}
"""
# boot.img (the MBR's boot code) as grub-bios-setup patches it (grub's include/grub/i386/pc/boot.h).
MBR_BPB = slice(0x03, 0x5A)  # kept from the disk's own sector 0
MBR_KERNEL_SECTOR = 0x5C  # u64: where core.img starts
MBR_DRIVE_CHECK = 0x66  # a 2-byte jump, NOPs on a hard disk (BIOSes passing a wrong boot drive)
MBR_TABLE = slice(0x1B8, 0x1FE)  # disk signature and partition table: the protective MBR's
BLOCKLIST = 0x200 - 12  # diskboot.img's (core.img's first sector's) u64 start, u16 sectors, u16 segment
OS_RELEASE = 'ID=aurae-host\nNAME="auraed host image"\nPRETTY_NAME="auraed host image {digest}"\n'


class DiskError(Exception):
    pass


def run(args: list[str], **kwargs: object) -> str:
    try:
        result = subprocess.run(args, capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload]
    except FileNotFoundError as exc:
        raise DiskError(f"cannot run {args[0]}: {exc.strerror} (run hack/setup)") from exc
    if result.returncode != 0:
        raise DiskError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    out: str = result.stdout
    return out


def guid(digest: str, what: str) -> str:
    """A GUID derived from the inputs hash: the same inputs make the same partition table."""
    return str(uuid.UUID(hashlib.sha256(f"{digest}:{what}".encode()).hexdigest()[:32], version=4))


def stub_end(stub: Path) -> int:
    """The first free virtual address after the stub's sections (objdump's VMA + size)."""
    end = 0
    for line in run(["objdump", "-h", "-w", str(stub)], env={**os.environ, "LC_ALL": "C"}).splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[0].isdigit():
            end = max(end, int(fields[3], 16) + int(fields[2], 16))
    if end == 0:
        raise DiskError(f"objdump shows no sections in {stub}")
    return end


def make_uki(stub: Path, kernel: Path, initramfs: Path, out: Path, *, cmdline: str, os_release: str) -> None:
    """kernel + initramfs + command line in one EFI program (the sections systemd-stub reads)."""
    work = out.parent
    (work / "uki-cmdline").write_text(cmdline + "\0")
    (work / "uki-osrel").write_text(os_release)
    sections = [
        (".osrel", work / "uki-osrel"),
        (".cmdline", work / "uki-cmdline"),
        (".initrd", initramfs),
        (".linux", kernel),  # last: the kernel may use memory past its own size
    ]
    args = ["objcopy"]
    address = stub_end(stub)
    for name, path in sections:
        address = (address + 0xFFFF) & ~0xFFFF
        args += [
            "--add-section", f"{name}={path}",
            "--change-section-vma", f"{name}={address:#x}",
        ]  # fmt: skip
        address += path.stat().st_size
    run([*args, str(stub), str(out)])
    for name in ("uki-cmdline", "uki-osrel"):
        (work / name).unlink()


def make_esp(out: Path, digest: str, files: dict[str, Path]) -> None:
    """A FAT32 ESP holding ``files`` (path on the ESP -> file)."""
    with out.open("wb") as handle:
        handle.truncate(ESP_MIB * MIB)
    run(["mkfs.fat", "-F", "32", "-s", "1", "-n", "AURAE-ESP", "-i", digest[:8], "--invariant", str(out)])
    env = {**os.environ, "MTOOLS_SKIP_CHECK": "1"}
    parts = [name.split("/")[:-1] for name in files]
    directories = sorted({"/".join(path[:depth]) for path in parts for depth in range(1, len(path) + 1)})
    run(["mmd", "-i", str(out), *(f"::/{d}" for d in directories)], env=env)
    for name, path in files.items():
        run(["mcopy", "-i", str(out), str(path), f"::/{name}"], env=env)


def make_grub_core(grub_dir: Path, out: Path) -> None:
    """core.img: diskboot.img's sector, then GRUB's kernel with GRUB_MODULES, lzma-compressed."""
    run([
        "grub-mkimage", "-O", "i386-pc", "-d", str(grub_dir), "-o", str(out), "-p", GRUB_PREFIX,
        *GRUB_MODULES,
    ])  # fmt: skip
    size = out.stat().st_size
    if size > (BIOS_LAST - BIOS_FIRST + 1) * SECTOR:
        raise DiskError(f"GRUB's core.img ({size} bytes) does not fit the BIOS boot partition")


def install_grub(disk: Path, boot_img: Path, core_img: Path) -> None:
    """boot.img into sector 0 around the protective MBR's table, core.img into the BIOS boot
    partition, each pointing at the next (what grub-bios-setup does to a device)."""
    core = bytearray(core_img.read_bytes())
    sectors = -(-len(core) // SECTOR)
    start, count, segment = struct.unpack_from("<QHH", core, BLOCKLIST)
    if count != sectors - 1 or segment != 0x820:
        raise DiskError(f"{core_img}: unexpected blocklist ({start}, {count}, {segment:#x})")
    struct.pack_into("<Q", core, BLOCKLIST, BIOS_FIRST + 1)  # the rest follows its first sector
    boot = bytearray(boot_img.read_bytes())
    if len(boot) != SECTOR or boot[0x1FE:] != b"\x55\xaa":
        raise DiskError(f"{boot_img} is not a boot sector")
    with disk.open("r+b") as target:
        mbr = target.read(SECTOR)
        boot[MBR_BPB] = mbr[MBR_BPB]
        boot[MBR_TABLE] = mbr[MBR_TABLE]
        struct.pack_into("<Q", boot, MBR_KERNEL_SECTOR, BIOS_FIRST)
        boot[MBR_DRIVE_CHECK : MBR_DRIVE_CHECK + 2] = b"\x90\x90"
        target.seek(0)
        target.write(boot)
        target.seek(BIOS_FIRST * SECTOR)
        target.write(bytes(core).ljust(sectors * SECTOR, b"\0"))


def sign(uki: Path, key: Path, certificate: Path) -> None:
    """Sign ``uki`` in place for Secure Boot (sbsigntool), and check the signature."""
    signed = uki.with_name(uki.name + ".signed")
    run(["sbsign", "--key", str(key), "--cert", str(certificate), "--output", str(signed), str(uki)])
    run(["sbverify", "--cert", str(certificate), str(signed)])
    signed.rename(uki)


@dataclass(frozen=True)
class SignedChain:
    """Debian's signed UEFI boot chain (:data:`SHIM`, :data:`MOK_MANAGER`, :data:`GRUB_EFI`)."""

    shim: Path
    mok_manager: Path
    grub: Path

    @classmethod
    def from_trees(cls, trees: dict[str, Path]) -> SignedChain:
        """The files in the packages' extracted trees (package name -> tree)."""
        return cls(*(trees[package] / path for package, path in (SHIM, MOK_MANAGER, GRUB_EFI)))


def signers(program: Path) -> list[str]:
    """The subjects of the certificates that signed ``program`` (its first one's chain first)."""
    return [
        line.split("subject:", 1)[1].strip()
        for line in run(["sbverify", "--list", str(program)]).splitlines()
        if line.strip().startswith("- subject:")
    ]


def make_disk(
    work: Path,
    stub: Path,
    grub_dir: Path,
    digest: str,
    chain: SignedChain,
    *,
    disk_mib: int = DISK_MIB,
    signer: tuple[Path, Path] | None = None,
) -> dict[str, object]:
    """``work/disk.img`` from ``work``'s vmlinuz, initramfs.img and rootfs.img, booted by UEFI with
    Debian's signed ``chain`` (shim, GRUB) at the removable-media path or with ``stub``'s UKI
    (systemd-stub; signed with ``signer``'s key and certificate for Secure Boot) by a boot entry,
    or by BIOS with GRUB's ``grub_dir``; returns its layout for the manifest."""
    uki = work / "aurae.efi"
    esp = work / "esp.img"
    disk = work / "disk.img"
    grub_cfg = work / "grub.cfg"
    efi_grub_cfg = work / "efi-grub.cfg"
    core_img = work / "core.img"
    os_release = OS_RELEASE.format(digest=digest)
    for path in (chain.shim, chain.mok_manager, chain.grub):
        if not path.is_file():
            raise DiskError(f"{path} is missing (its package's file names changed?)")
    make_uki(stub, work / "vmlinuz", work / "initramfs.img", uki, cmdline=CMDLINE, os_release=os_release)
    try:
        if signer is not None:
            sign(uki, *signer)
        make_grub_core(grub_dir, core_img)
        grub_cfg.write_text(GRUB_CFG.format(digest=digest, cmdline=CMDLINE))
        efi_grub_cfg.write_text(EFI_GRUB_CFG.format(digest=digest, cmdline=CMDLINE))
        make_esp(
            esp,
            digest,
            {
                EFI_BOOT: chain.shim,
                EFI_GRUB: chain.grub,
                EFI_MOK_MANAGER: chain.mok_manager,
                EFI_GRUB_CFG_PATH: efi_grub_cfg,
                UKI_PATH: uki,
                "grub/grub.cfg": grub_cfg,
                "aurae/vmlinuz": work / "vmlinuz",
                "aurae/initramfs.img": work / "initramfs.img",
            },
        )
        uki_size = uki.stat().st_size
    finally:
        uki.unlink(missing_ok=True)
        grub_cfg.unlink(missing_ok=True)
        efi_grub_cfg.unlink(missing_ok=True)
    rootfs = work / "rootfs.img"
    root_mib = -(-rootfs.stat().st_size // (ROOT_ALIGN_MIB * MIB)) * ROOT_ALIGN_MIB
    if 1 + ESP_MIB + root_mib + 64 + 1 > disk_mib:
        raise DiskError(f"a {disk_mib} MiB disk leaves under 64 MiB for the data partition")
    with disk.open("wb") as handle:
        handle.truncate(disk_mib * MIB)
    run([
        "sgdisk", "--clear", f"--disk-guid={guid(digest, 'disk')}",
        f"--new=1:1M:+{ESP_MIB}M", f"--typecode=1:{ESP_TYPE}", f"--change-name=1:{ESP_NAME}",
        f"--partition-guid=1:{guid(digest, ESP_NAME)}",
        f"--new=2:0:+{root_mib}M", f"--typecode=2:{ROOT_TYPE}", f"--change-name=2:{ROOT_NAME}",
        f"--partition-guid=2:{guid(digest, ROOT_NAME)}", f"--attributes=2:set:{READ_ONLY_ATTRIBUTE}",
        "--new=3:0:0", f"--typecode=3:{DATA_TYPE}", f"--change-name=3:{DATA_NAME}",
        f"--partition-guid=3:{guid(digest, DATA_NAME)}",
        "--set-alignment=1", f"--new=4:{BIOS_FIRST}:{BIOS_LAST}", f"--typecode=4:{BIOS_TYPE}",
        f"--change-name=4:{BIOS_NAME}", f"--partition-guid=4:{guid(digest, BIOS_NAME)}",
        str(disk),
    ])  # fmt: skip
    layout = partitions(disk)
    with disk.open("r+b") as target:
        for name, source in ((ESP_NAME, esp), (ROOT_NAME, rootfs)):
            start, size = layout[name]
            if source.stat().st_size > size:
                raise DiskError(f"{source.name} does not fit partition {name}")
            target.seek(start)
            with source.open("rb") as data:
                shutil.copyfileobj(data, target, MIB)
    esp.unlink()
    try:
        install_grub(disk, grub_dir / "boot.img", core_img)
        core_size = core_img.stat().st_size
    finally:
        core_img.unlink()
    run(["sgdisk", "--verify", str(disk)])
    return {
        "size": disk_mib * MIB,
        "boot": "UEFI: \\EFI\\BOOT\\BOOTX64.EFI, Debian's shim, then its signed GRUB"
        " (\\EFI\\BOOT\\grubx64.efi, \\EFI\\debian\\grub.cfg): /aurae/vmlinuz, /aurae/initramfs.img",
        "shim_signed_by": signers(chain.shim),
        "grub_efi_signed_by": signers(chain.grub),
        "uki": "\\EFI\\aurae\\aurae.efi, a unified kernel image (systemd-stub), for a boot entry",
        "bios_boot": "GRUB: boot.img in the MBR, core.img in aurae-bios, /grub/grub.cfg on the ESP",
        "uki_bytes": uki_size,
        "uki_signed_by": "" if signer is None else signer_subject(signer[1]),
        "grub_core_bytes": core_size,
        "cmdline": CMDLINE,
        "partitions": {name: {"offset": start, "size": size} for name, (start, size) in layout.items()},
    }


def signer_subject(certificate: Path) -> str:
    args = ["openssl", "x509", "-in", str(certificate), "-noout", "-subject", "-fingerprint", "-sha256"]
    return " ".join(run(args).split())


def partitions(disk: Path) -> dict[str, tuple[int, int]]:
    """GPT name -> (byte offset, byte size), from ``sgdisk --print``."""
    found: dict[str, tuple[int, int]] = {}
    for line in run(["sgdisk", "--print", str(disk)], env={**os.environ, "LC_ALL": "C"}).splitlines():
        fields = line.split()
        if len(fields) >= 7 and fields[0].isdigit() and fields[1].isdigit():
            first, last = int(fields[1]), int(fields[2])
            found[fields[-1]] = (first * SECTOR, (last - first + 1) * SECTOR)
    if set(found) != {ESP_NAME, ROOT_NAME, DATA_NAME, BIOS_NAME}:
        raise DiskError(f"unexpected partitions in {disk}: {sorted(found)}")
    return found
