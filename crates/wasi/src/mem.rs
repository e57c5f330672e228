//! Bounds-checked access to guest memory. Every out-of-bounds access is `EFAULT`.

use crate::Errno;

pub(crate) struct Mem<'a>(pub &'a mut [u8]);

impl Mem<'_> {
    pub fn slice(&self, ptr: u32, len: u32) -> Result<&[u8], Errno> {
        let start = ptr as usize;
        let end = start.checked_add(len as usize).ok_or(Errno::Fault)?;
        self.0.get(start..end).ok_or(Errno::Fault)
    }

    pub fn slice_mut(&mut self, ptr: u32, len: u32) -> Result<&mut [u8], Errno> {
        let start = ptr as usize;
        let end = start.checked_add(len as usize).ok_or(Errno::Fault)?;
        self.0.get_mut(start..end).ok_or(Errno::Fault)
    }

    pub fn u32(&self, ptr: u32) -> Result<u32, Errno> {
        let b = self.slice(ptr, 4)?;
        Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }

    pub fn u64(&self, ptr: u32) -> Result<u64, Errno> {
        let b = self.slice(ptr, 8)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    pub fn u16(&self, ptr: u32) -> Result<u16, Errno> {
        let b = self.slice(ptr, 2)?;
        Ok(u16::from_le_bytes(b.try_into().expect("2 bytes")))
    }

    pub fn put(&mut self, ptr: u32, bytes: &[u8]) -> Result<(), Errno> {
        self.slice_mut(ptr, bytes.len() as u32)?
            .copy_from_slice(bytes);
        Ok(())
    }

    pub fn put_u32(&mut self, ptr: u32, v: u32) -> Result<(), Errno> {
        self.put(ptr, &v.to_le_bytes())
    }

    pub fn put_u64(&mut self, ptr: u32, v: u64) -> Result<(), Errno> {
        self.put(ptr, &v.to_le_bytes())
    }

    pub fn str(&self, ptr: u32, len: u32) -> Result<&str, Errno> {
        std::str::from_utf8(self.slice(ptr, len)?).map_err(|_| Errno::Inval)
    }

    /// The `(ptr, len)` pairs of an iovec array.
    pub fn iovecs(&self, ptr: u32, count: u32) -> Result<Vec<(u32, u32)>, Errno> {
        if count > 1024 {
            return Err(Errno::Inval);
        }
        (0..count)
            .map(|i| Ok((self.u32(ptr + i * 8)?, self.u32(ptr + i * 8 + 4)?)))
            .collect()
    }
}
