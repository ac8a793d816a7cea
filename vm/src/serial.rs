//! The 16550 serial console (vm-superio), its interrupt as an irqfd, its output into the console log.

use std::io;
use std::sync::{Arc, Mutex};

use sandbox_control::console::ConsoleLog;
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

/// COM1's I/O ports and interrupt line.
pub const COM1_BASE: u16 = 0x3f8;
/// COM1 occupies eight ports.
pub const COM1_LEN: u16 = 8;
/// COM1's IRQ (GSI on the in-kernel irqchip).
pub const COM1_IRQ: u32 = 4;

/// Raises the serial interrupt through an eventfd registered as an irqfd.
pub struct IrqTrigger(pub EventFd);

impl Trigger for IrqTrigger {
    type E = io::Error;
    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

/// Where the guest's console output goes: the bounded log, and a copy to the sink if any.
pub struct LogWriter(
    pub Arc<Mutex<ConsoleLog>>,
    pub Option<crate::machine::config::ConsoleSink>,
);

impl io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).write(buf);
        if let Some(sink) = &self.1 {
            (sink.0)(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The console device.
pub type Console = Serial<IrqTrigger, vm_superio::serial::NoEvents, LogWriter>;

/// A console writing into `log`, interrupting through `irq`.
pub fn console(
    irq: EventFd,
    log: Arc<Mutex<ConsoleLog>>,
    sink: Option<crate::machine::config::ConsoleSink>,
) -> Console {
    Serial::new(IrqTrigger(irq), LogWriter(log, sink))
}

/// A console in the state a snapshot recorded.
pub fn restored(
    state: &crate::snapshot::SerialSnapshot,
    irq: EventFd,
    log: Arc<Mutex<ConsoleLog>>,
    sink: Option<crate::machine::config::ConsoleSink>,
) -> Result<Console, String> {
    Serial::from_state(
        &state.state(),
        IrqTrigger(irq),
        vm_superio::serial::NoEvents,
        LogWriter(log, sink),
    )
    .map_err(|e| format!("the serial port's saved state: {e:?}"))
}
