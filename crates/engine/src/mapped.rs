//! Guest memory mapped from the store's packs: a restore replaces a memory's pages with the
//! packs' own (copy-on-write), instead of copying the chunks in. Both engines do it for the
//! memories they keep in a reservation of their own (wasmtime's memories; the interpreter's
//! memory 0, see `interp::Reservation`).

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Mappings of packs into the memories of all live instances of this process. The kernel
/// allows a process ~65,000 mappings in all (`vm.max_map_count`), which wasmtime needs too:
/// beyond [`MAX_LIVE_MAPPINGS`] chunks are copied instead (a space restores many guests).
static MAPPINGS: AtomicUsize = AtomicUsize::new(0);
const MAX_LIVE_MAPPINGS: usize = 32_768;

/// Maps `len` bytes of `file` from `offset` over `data[at..at + len]`, adding one to `mine`
/// (the instance's count, given back with [`released`] when its memories are gone).
/// `Ok(false)`: not done (not page-aligned, too many mappings, or the kernel refused), the
/// memory as it was. `Err`: the bytes there were lost.
///
/// # Safety
///
/// `data` must be a guest memory's accessible bytes, mapped read-write by the engine for the
/// memory's whole life and unmapped whole (with whatever replaced its pages) when the memory
/// is dropped; nothing else may borrow them meanwhile.
pub(crate) unsafe fn map_file(
    data: &mut [u8],
    at: usize,
    file: &std::fs::File,
    offset: u64,
    len: usize,
    mine: &mut usize,
) -> Result<bool, String> {
    let page = crate::dirty::page_size();
    let Ok(file_at) = libc::off_t::try_from(offset) else {
        return Ok(false);
    };
    if at.checked_add(len).is_none_or(|end| end > data.len())
        || !(data.as_ptr() as usize + at).is_multiple_of(page)
        || !len.is_multiple_of(page)
        || !offset.is_multiple_of(page as u64)
    {
        return Ok(false);
    }
    let start = data[at..].as_mut_ptr().cast::<libc::c_void>();
    if MAPPINGS.fetch_add(1, Relaxed) >= MAX_LIVE_MAPPINGS {
        MAPPINGS.fetch_sub(1, Relaxed);
        return Ok(false);
    }
    let fixed = libc::MAP_PRIVATE | libc::MAP_FIXED;
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: `start..start + len` lies within the memory's accessible bytes (checked above),
    // which the caller vouches for. The new mapping replaces those pages in place with the
    // same protection.
    let r = unsafe { libc::mmap(start, len, rw, fixed, file.as_raw_fd(), file_at) };
    if r != libc::MAP_FAILED {
        *mine += 1;
        return Ok(true);
    }
    let err = std::io::Error::last_os_error();
    MAPPINGS.fetch_sub(1, Relaxed);
    // A failed MAP_FIXED may have unmapped the range already: put anonymous pages back
    // (zeros: the caller then reads these chunks, as for an engine that cannot map).
    // SAFETY: as above, with anonymous zero pages in place of the file's.
    let back = unsafe { libc::mmap(start, len, rw, fixed | libc::MAP_ANONYMOUS, -1, 0) };
    if back == libc::MAP_FAILED {
        return Err(format!(
            "mapping memory from a pack failed ({err}), and so did undoing it"
        ));
    }
    tracing::debug!(%err, "mapping a pack into memory failed; reading instead");
    Ok(false)
}

/// An instance's `n` mappings are gone (its memories were unmapped).
pub(crate) fn released(n: usize) {
    MAPPINGS.fetch_sub(n, Relaxed);
}
