//! LEB128 varints and a bounds-checked reader for the format's encodings.

use super::FormatError;

pub(crate) fn put_u64(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

pub(crate) fn put_i64(out: &mut Vec<u8>, v: i64) {
    put_u64(out, ((v << 1) ^ (v >> 63)) as u64);
}

pub(crate) fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_u64(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// Reads a byte slice front to back; every read is bounds-checked.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.pos == self.buf.len()
    }

    fn err(&self, what: &str) -> FormatError {
        FormatError::MalformedTree(format!("{what} at byte {}", self.pos))
    }

    pub(crate) fn u8(&mut self) -> Result<u8, FormatError> {
        let b = *self
            .buf
            .get(self.pos)
            .ok_or_else(|| self.err("truncated"))?;
        self.pos += 1;
        Ok(b)
    }

    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], FormatError> {
        let end = self
            .pos
            .checked_add(n)
            .ok_or_else(|| self.err("length overflow"))?;
        let s = self
            .buf
            .get(self.pos..end)
            .ok_or_else(|| self.err("truncated"))?;
        self.pos = end;
        Ok(s)
    }

    pub(crate) fn u64(&mut self) -> Result<u64, FormatError> {
        let mut v: u64 = 0;
        for shift in (0..64).step_by(7) {
            let b = self.u8()?;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                if shift == 63 && b > 1 {
                    return Err(self.err("varint overflow"));
                }
                return Ok(v);
            }
        }
        Err(self.err("varint too long"))
    }

    pub(crate) fn u32(&mut self) -> Result<u32, FormatError> {
        let v = self.u64()?;
        u32::try_from(v).map_err(|_| self.err("value exceeds 32 bits"))
    }

    pub(crate) fn i64(&mut self) -> Result<i64, FormatError> {
        let v = self.u64()?;
        Ok(((v >> 1) as i64) ^ -((v & 1) as i64))
    }

    /// A length-prefixed byte string of at most `max` bytes.
    pub(crate) fn bytes(&mut self, max: usize) -> Result<&'a [u8], FormatError> {
        let len = self.u64()?;
        if len > max as u64 {
            return Err(self.err(&format!("length {len} exceeds {max}")));
        }
        self.take(len as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_edge_values() {
        let values = [0u64, 1, 127, 128, 300, u32::MAX as u64, u64::MAX];
        let mut buf = Vec::new();
        for v in values {
            put_u64(&mut buf, v);
        }
        for v in [0i64, -1, 1, i64::MIN, i64::MAX] {
            put_i64(&mut buf, v);
        }
        let mut r = Reader::new(&buf);
        for v in values {
            assert_eq!(r.u64().unwrap(), v);
        }
        for v in [0i64, -1, 1, i64::MIN, i64::MAX] {
            assert_eq!(r.i64().unwrap(), v);
        }
        assert!(r.is_empty());
    }

    #[test]
    fn truncated_and_overlong_input_is_an_error_not_a_panic() {
        assert!(Reader::new(&[0x80]).u64().is_err());
        assert!(Reader::new(&[0xff; 11]).u64().is_err());
        let mut buf = Vec::new();
        put_u64(&mut buf, 1000);
        assert!(Reader::new(&buf).bytes(10).is_err());
    }
}
