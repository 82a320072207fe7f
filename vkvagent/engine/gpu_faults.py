"""What a GPU's XID means, and which ones mean a restart of vLLM cannot help.

Knowledge, not I/O: ``gpu`` reads the codes through NVML, the diagnosis vetoes restarts on the
faults, and the actuator names them.
"""

from __future__ import annotations

# XIDs: what each code means and what usually causes it, after NVIDIA's "Xid Errors"
# catalogue (docs.nvidia.com/deploy/xid-errors/, the Xid error listing of driver r555, and the
# Xid catalog of r570 and later, docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html,
# for 144-150 and the immediate actions). The listing marks each code's possible causes (HW
# Error, Driver Error, User App Error, System Memory Corruption, Bus Error, Thermal Issue, FB
# Corruption); one class is kept per code:
#   "application": the listing names the application as a cause and it is the usual one, the
#       GPU staying healthy (13, 31, 43, 45 and 68 are the codes NVIDIA's own Kubernetes device
#       plugin skips as application errors; 137 marks the application alone). A restart of
#       vLLM is the cure, so these never veto one.
#   "hardware": the GPU, its memory, NVLink, C2C or the bus, and codes whose only causes are
#       bus errors, thermal issues or memory corruption; "driver": the driver or its firmware.
# The class follows the listing's causes, not the catalog's immediate action: a hardware code
# first answered by restarting the application (69, 80, 94) still leaves the fault on the GPU.
# Where the listing marks the application but also the driver or hardware and the code is not
# one of NVIDIA's application errors (8), or the catalog asks for a GPU reset (109), the code
# is kept as a fault. An XID not in this table is "unknown" and counted as a fault, to be safe.
XID_APPLICATION, XID_DRIVER, XID_HARDWARE, XID_UNKNOWN = (
    "application",
    "driver",
    "hardware",
    "unknown",
)
# The classes that mean a restart of vLLM cannot help: they veto restarts.
FAULT_CLASSES = frozenset({XID_HARDWARE, XID_DRIVER, XID_UNKNOWN})
XIDS: dict[int, tuple[str, str]] = {
    # Driver, application, bus and thermal causes; not one of NVIDIA's application errors.
    8: ("GPU stopped processing", XID_DRIVER),
    13: ("Graphics Engine Exception", XID_APPLICATION),  # every cause marked; usually the app
    31: ("GPU memory page fault", XID_APPLICATION),  # HW, driver, app: an illegal access
    32: ("Invalid or corrupted push buffer stream", XID_DRIVER),  # driver, bus, memory
    38: ("Driver firmware error", XID_DRIVER),
    43: ("GPU stopped processing", XID_APPLICATION),  # driver, app: a reset channel
    44: ("Graphics Engine fault during context switch", XID_DRIVER),
    # Driver, app: cleanup after another error; that error's own XID says if it was a fault.
    45: ("Preemptive cleanup, due to previous errors", XID_APPLICATION),
    46: ("GPU stopped processing", XID_DRIVER),  # the catalog: reset the GPU
    48: ("Double Bit ECC Error", XID_HARDWARE),
    56: ("Display Engine error", XID_HARDWARE),
    57: ("Error programming video memory interface", XID_HARDWARE),
    58: ("Unstable video memory interface detected", XID_HARDWARE),
    # No cause marked; the PMU, as 62, and the catalog says to contact support.
    61: ("Internal micro-controller breakpoint/warning", XID_HARDWARE),
    62: ("Internal micro-controller halt", XID_HARDWARE),
    63: ("ECC page retirement or row remapping recording event", XID_HARDWARE),
    64: ("ECC page retirement or row remapper recording failure", XID_HARDWARE),
    68: ("NVDEC0 Exception", XID_APPLICATION),  # HW, driver, app; an application error to NVIDIA
    69: ("Graphics Engine class error", XID_HARDWARE),
    74: ("NVLINK Error", XID_HARDWARE),
    79: ("GPU has fallen off the bus", XID_HARDWARE),
    80: ("Corrupted data sent to GPU", XID_HARDWARE),
    92: ("High single-bit ECC error rate", XID_HARDWARE),
    94: ("Contained ECC error", XID_HARDWARE),
    95: ("Uncontained ECC error", XID_HARDWARE),
    # Every cause marked, but the catalog's immediate action is a GPU reset, not a restart.
    109: ("Context Switch Timeout Error", XID_DRIVER),
    119: ("GSP RPC Timeout", XID_DRIVER),
    120: ("GSP Error", XID_DRIVER),
    121: ("C2C Link Error", XID_HARDWARE),
    137: ("NVLink FLA privilege error", XID_APPLICATION),  # only the application marked
    140: ("Unrecovered ECC Error", XID_HARDWARE),
    143: ("GPU Initialization Failure", XID_HARDWARE),
    144: ("NVLINK: SAW Error", XID_HARDWARE),
    145: ("NVLINK: RLW Error", XID_HARDWARE),
    146: ("NVLINK: TLW Error", XID_HARDWARE),
    147: ("NVLINK: TREX Error", XID_HARDWARE),
    148: ("NVLINK: NVLPW_CTRL Error", XID_HARDWARE),
    149: ("NVLINK: NETIR Error", XID_HARDWARE),
    150: ("NVLINK: MSE Error", XID_HARDWARE),
}


def xid_class(code: int) -> str:
    """The code's class, from ``XIDS``; ``XID_UNKNOWN`` for a code not there."""
    entry = XIDS.get(code)
    return entry[1] if entry else XID_UNKNOWN


def xid_meaning(code: int) -> str:
    """NVIDIA's short name for the code, or "not in vkvagent's XID table"."""
    entry = XIDS.get(code)
    return entry[0] if entry else "not in vkvagent's XID table"


def is_fault(code: int) -> bool:
    """Whether the XID vetoes restarts: hardware, driver and unknown codes do (conservative),
    application ones do not, as a restart of vLLM is what fixes those."""
    return xid_class(code) in FAULT_CLASSES


def describe_xid(code: int) -> str:
    """E.g. ``XID 79 (GPU has fallen off the bus; hardware)``."""
    return f"XID {code} ({xid_meaning(code)}; {xid_class(code)})"
