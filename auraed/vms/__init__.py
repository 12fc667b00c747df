"""VmService: guest VMs (QEMU, cloud-hypervisor), their networking, and placing work in them."""
