//! The driver's management library (NVML, `libnvidia-ml.so.1`), loaded at run time, for the
//! clock monitor (`backend::clocks`): the SM clock, the board power and the clock event reasons
//! of one device, found by its PCI bus id (CUDA's ordinals and NVML's indices can differ).

use std::ffi::{c_char, c_void, CString};
use std::sync::Arc;

use libloading::Library;

use crate::backend::clocks::{ClockSample, ClockSource};

type Device = *mut c_void;
type Ret = u32;
const SUCCESS: Ret = 0;
const CLOCK_SM: u32 = 1;

/// The functions the monitor calls. Built right after `nvmlInit_v2` succeeds; dropping it calls
/// `nvmlShutdown` (NVML counts inits) before the library is unloaded.
struct Api {
    get_clock: unsafe extern "C" fn(Device, u32, *mut u32) -> Ret,
    get_power: unsafe extern "C" fn(Device, *mut u32) -> Ret,
    get_reasons: unsafe extern "C" fn(Device, *mut u64) -> Ret,
    shutdown: unsafe extern "C" fn() -> Ret,
    // Declared last: fields drop in order, so the library outlives the shutdown call.
    _lib: Library,
}

impl Drop for Api {
    fn drop(&mut self) {
        // SAFETY: balances the nvmlInit_v2 this value was built after; no handle outlives it
        // (each NvmlDevice holds the Arc).
        unsafe { (self.shutdown)() };
    }
}

/// One device's NVML handle.
pub struct NvmlDevice {
    api: Arc<Api>,
    dev: Device,
    /// The device's highest SM clock (MHz) and its enforced power limit (mW), where NVML gives
    /// them.
    pub max_mhz: Option<u32>,
    pub limit_mw: Option<u32>,
}

// SAFETY: NVML is thread-safe; the handle is an opaque pointer NVML owns for the process.
unsafe impl Send for NvmlDevice {}

/// Opens NVML and the device at `pci_bus_id` (`domain:bus:device.function`, hex).
pub fn open(pci_bus_id: &str) -> Result<NvmlDevice, String> {
    // SAFETY: loading the driver's own library runs its initialisers, which have no
    // preconditions; each symbol is cast to its documented C signature.
    unsafe {
        let lib = Library::new("libnvidia-ml.so.1").map_err(|e| format!("libnvidia-ml.so.1: {e}"))?;
        let sym = |name: &[u8]| -> Result<*const c_void, String> {
            lib.get::<*const c_void>(name)
                .map(|s| *s)
                .map_err(|e| format!("{}: {e}", String::from_utf8_lossy(&name[..name.len() - 1])))
        };
        let init: unsafe extern "C" fn() -> Ret = std::mem::transmute(sym(b"nvmlInit_v2\0")?);
        let by_bus: unsafe extern "C" fn(*const c_char, *mut Device) -> Ret =
            std::mem::transmute(sym(b"nvmlDeviceGetHandleByPciBusId_v2\0")?);
        let max_clock: unsafe extern "C" fn(Device, u32, *mut u32) -> Ret =
            std::mem::transmute(sym(b"nvmlDeviceGetMaxClockInfo\0")?);
        let limit: unsafe extern "C" fn(Device, *mut u32) -> Ret =
            std::mem::transmute(sym(b"nvmlDeviceGetEnforcedPowerLimit\0")?);
        // The newer name first (drivers from R535), the older one otherwise.
        let reasons = sym(b"nvmlDeviceGetCurrentClocksEventReasons\0")
            .or_else(|_| sym(b"nvmlDeviceGetCurrentClocksThrottleReasons\0"))?;
        let get_clock: unsafe extern "C" fn(Device, u32, *mut u32) -> Ret =
            std::mem::transmute(sym(b"nvmlDeviceGetClockInfo\0")?);
        let get_power: unsafe extern "C" fn(Device, *mut u32) -> Ret =
            std::mem::transmute(sym(b"nvmlDeviceGetPowerUsage\0")?);
        let get_reasons: unsafe extern "C" fn(Device, *mut u64) -> Ret = std::mem::transmute(reasons);
        let shutdown: unsafe extern "C" fn() -> Ret = std::mem::transmute(sym(b"nvmlShutdown\0")?);
        let rc = init();
        if rc != SUCCESS {
            return Err(format!("nvmlInit_v2 returned {rc}"));
        }
        // From here on, dropping `api` (an error return included) shuts NVML down again.
        let api = Arc::new(Api { get_clock, get_power, get_reasons, shutdown, _lib: lib });
        let bus = CString::new(pci_bus_id).map_err(|_| format!("PCI bus id {pci_bus_id:?}"))?;
        let mut dev: Device = std::ptr::null_mut();
        let rc = by_bus(bus.as_ptr(), &mut dev);
        if rc != SUCCESS {
            return Err(format!("no NVML device at PCI bus id {pci_bus_id} (error {rc})"));
        }
        let (mut max_mhz, mut limit_mw) = (0u32, 0u32);
        let max_mhz = (max_clock(dev, CLOCK_SM, &mut max_mhz) == SUCCESS).then_some(max_mhz);
        let limit_mw = (limit(dev, &mut limit_mw) == SUCCESS).then_some(limit_mw);
        let mut d = NvmlDevice { api, dev, max_mhz, limit_mw };
        // A device whose clock, power or reasons NVML cannot read would give no sample at all:
        // say so now rather than report an empty run.
        d.read().map_err(|(what, rc)| format!("NVML cannot read this device's {what} (error {rc})"))?;
        Ok(d)
    }
}

impl NvmlDevice {
    /// One reading, or which query failed and its error code.
    fn read(&mut self) -> Result<ClockSample, (&'static str, Ret)> {
        let (mut sm_mhz, mut power_mw, mut reasons) = (0u32, 0u32, 0u64);
        // SAFETY: a live handle and out-pointers to locals of the right types.
        unsafe {
            let rc = (self.api.get_clock)(self.dev, CLOCK_SM, &mut sm_mhz);
            if rc != SUCCESS {
                return Err(("SM clock", rc));
            }
            let rc = (self.api.get_power)(self.dev, &mut power_mw);
            if rc != SUCCESS {
                return Err(("power", rc));
            }
            let rc = (self.api.get_reasons)(self.dev, &mut reasons);
            if rc != SUCCESS {
                return Err(("clock event reasons", rc));
            }
        }
        Ok(ClockSample { sm_mhz, power_mw, reasons })
    }
}

impl ClockSource for NvmlDevice {
    fn sample(&mut self) -> Option<ClockSample> {
        self.read().ok()
    }
}
