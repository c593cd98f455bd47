//! Server-sent events: an incremental splitter that yields whole events as their bytes
//! arrive. (The Chat/Completions assembler that rebuilds a whole response from streamed
//! chunks, the tee, lives with its dialect: `dialect::chat::Assembler`.)

use bytes::{Bytes, BytesMut};

/// One complete SSE event: its raw bytes (relayed unchanged) and its joined `data:` payload.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub raw: Bytes,
    pub data: Option<String>,
}

impl Event {
    pub fn is_done(&self) -> bool {
        self.data.as_deref().map(str::trim) == Some("[DONE]")
    }
}

/// Splits a byte stream into SSE events. Holds at most one unfinished event.
#[derive(Debug, Default)]
pub struct Splitter {
    buf: BytesMut,
    scanned: usize,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SseError {
    #[error("an SSE event grew past {0} bytes without ending")]
    EventTooLarge(usize),
    #[error("an SSE event is not valid UTF-8")]
    InvalidUtf8,
}

impl Splitter {
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// Bytes buffered but not yet part of a complete event.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The next complete event, if its terminating blank line has arrived.
    pub fn next_event(&mut self, max_event: usize) -> Result<Option<Event>, SseError> {
        let start = self.scanned.saturating_sub(3);
        let found = find_blank_line(&self.buf[start..]).map(|(i, len)| (start + i, len));
        match found {
            None => {
                self.scanned = self.buf.len();
                if self.buf.len() > max_event {
                    return Err(SseError::EventTooLarge(max_event));
                }
                Ok(None)
            }
            Some((at, len)) => {
                let raw = self.buf.split_to(at + len).freeze();
                self.scanned = 0;
                let text = std::str::from_utf8(&raw[..at]).map_err(|_| SseError::InvalidUtf8)?;
                Ok(Some(Event {
                    data: parse_data(text),
                    raw,
                }))
            }
        }
    }

    /// What is left when the stream ends (an event with no terminating blank line).
    pub fn finish(&mut self) -> Option<Event> {
        if self.buf.iter().all(|b| b.is_ascii_whitespace()) {
            self.buf.clear();
            return None;
        }
        let raw = std::mem::take(&mut self.buf).freeze();
        let text = String::from_utf8_lossy(&raw).to_string();
        Some(Event {
            data: parse_data(&text),
            raw,
        })
    }
}

fn find_blank_line(b: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i + 1 < b.len() {
        if b[i] == b'\n' && b[i + 1] == b'\n' {
            return Some((i, 2));
        }
        if b[i] == b'\r' && i + 3 < b.len() && &b[i..i + 4] == b"\r\n\r\n" {
            return Some((i, 4));
        }
        if b[i] == b'\r' && b[i + 1] == b'\r' {
            return Some((i, 2));
        }
        i += 1;
    }
    None
}

fn parse_data(text: &str) -> Option<String> {
    let mut data: Option<String> = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("data:") else {
            continue;
        };
        let rest = rest.strip_prefix(' ').unwrap_or(rest);
        match &mut data {
            Some(d) => {
                d.push('\n');
                d.push_str(rest);
            }
            None => data = Some(rest.to_string()),
        }
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(s: &mut Splitter) -> Vec<Event> {
        let mut out = vec![];
        while let Some(e) = s.next_event(1 << 20).unwrap() {
            out.push(e);
        }
        out
    }

    #[test]
    fn splits_events_across_arbitrary_chunk_boundaries() {
        let stream = b"data: {\"a\":1}\n\ndata: {\"b\":2}\r\n\r\n: comment\ndata: x\ndata: y\n\ndata: [DONE]\n\n";
        for cut in 1..stream.len() {
            let mut s = Splitter::default();
            s.push(&stream[..cut]);
            let mut evs = drain(&mut s);
            s.push(&stream[cut..]);
            evs.extend(drain(&mut s));
            let datas: Vec<_> = evs.iter().map(|e| e.data.clone().unwrap()).collect();
            assert_eq!(
                datas,
                vec!["{\"a\":1}", "{\"b\":2}", "x\ny", "[DONE]"],
                "cut at {cut}"
            );
            let raw: Vec<u8> = evs.iter().flat_map(|e| e.raw.to_vec()).collect();
            assert_eq!(raw, stream.to_vec(), "raw bytes relayed unchanged");
            assert!(evs[3].is_done());
        }
    }

    #[test]
    fn oversized_event_is_an_error() {
        let mut s = Splitter::default();
        s.push(&[b'a'; 100]);
        assert_eq!(s.next_event(10), Err(SseError::EventTooLarge(10)));
    }
}
