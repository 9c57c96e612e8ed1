//! Framing: every message on an AgentJet stream is a little-endian `u32` length, then that
//! many bytes of postcard. A frame over the reader's limit is refused before its body is
//! read (the stream is then unusable and is dropped), so a peer cannot make us allocate
//! more than the limit.

use futures::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("stream i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("frame of {size} bytes is over the limit of {limit} bytes")]
    Oversize { size: usize, limit: usize },
    #[error("malformed {what} frame: {problem}")]
    Malformed { what: &'static str, problem: String },
    #[error("the stream closed before a {0} frame")]
    Closed(&'static str),
}

/// Writes one frame (and flushes). Refuses to send a frame over `limit` bytes.
pub async fn write_frame<W, T>(w: &mut W, msg: &T, limit: usize) -> Result<(), FrameError>
where
    W: AsyncWrite + Unpin,
    T: Serialize,
{
    let body = postcard::to_allocvec(msg).map_err(|e| FrameError::Malformed {
        what: std::any::type_name::<T>(),
        problem: e.to_string(),
    })?;
    write_raw(w, &body, limit).await
}

/// Writes already-encoded bytes as one frame.
pub async fn write_raw<W: AsyncWrite + Unpin>(
    w: &mut W,
    body: &[u8],
    limit: usize,
) -> Result<(), FrameError> {
    if body.len() > limit || body.len() > u32::MAX as usize {
        return Err(FrameError::Oversize {
            size: body.len(),
            limit,
        });
    }
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(body);
    w.write_all(&buf).await?;
    w.flush().await?;
    Ok(())
}

/// Reads one frame's bytes; `None` when the stream ended cleanly before a frame began.
pub async fn read_raw<R: AsyncRead + Unpin>(
    r: &mut R,
    limit: usize,
) -> Result<Option<Vec<u8>>, FrameError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let n = r.read(&mut len[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(FrameError::Io(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the stream ended inside a frame header",
            )));
        }
        got += n;
    }
    let size = u32::from_le_bytes(len) as usize;
    if size > limit {
        return Err(FrameError::Oversize { size, limit });
    }
    let mut body = vec![0u8; size];
    r.read_exact(&mut body).await?;
    Ok(Some(body))
}

/// Reads and decodes one frame; a clean end of stream is [`FrameError::Closed`].
pub async fn read_frame<R, T>(r: &mut R, limit: usize) -> Result<T, FrameError>
where
    R: AsyncRead + Unpin,
    T: DeserializeOwned,
{
    let what = short_name::<T>();
    let body = read_raw(r, limit).await?.ok_or(FrameError::Closed(what))?;
    decode(&body)
}

/// Decodes a frame body, naming the expected type in the error.
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    postcard::from_bytes(body).map_err(|e| FrameError::Malformed {
        what: short_name::<T>(),
        problem: e.to_string(),
    })
}

fn short_name<T>() -> &'static str {
    let full = std::any::type_name::<T>();
    full.rsplit("::").next().unwrap_or(full)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::io::Cursor;

    #[derive(Debug, PartialEq, Serialize, serde::Deserialize)]
    struct Msg {
        a: u32,
        b: Vec<u8>,
    }

    #[test]
    fn frames_round_trip_at_interesting_sizes_and_refuse_oversize() {
        futures::executor::block_on(async {
            for n in [0usize, 1, 127, 128, 1000] {
                let m = Msg {
                    a: n as u32,
                    b: vec![7; n],
                };
                let mut out = Vec::new();
                write_frame(&mut out, &m, 2000).await.unwrap();
                let mut c = Cursor::new(out);
                let back: Msg = read_frame(&mut c, 2000).await.unwrap();
                assert_eq!(back, m);
                assert!(matches!(
                    read_frame::<_, Msg>(&mut c, 2000).await,
                    Err(FrameError::Closed("Msg"))
                ));
            }
            // Over the reader's limit: refused from the header alone.
            let mut out = Vec::new();
            write_frame(
                &mut out,
                &Msg {
                    a: 1,
                    b: vec![0; 300],
                },
                2000,
            )
            .await
            .unwrap();
            let err = read_frame::<_, Msg>(&mut Cursor::new(out), 100)
                .await
                .unwrap_err();
            assert!(err.to_string().contains("over the limit of 100"), "{err}");
            // Over the writer's limit: not sent.
            let mut out = Vec::new();
            assert!(write_frame(
                &mut out,
                &Msg {
                    a: 1,
                    b: vec![0; 300]
                },
                100
            )
            .await
            .is_err());
            assert!(out.is_empty());
            // Garbage: a clear decode error.
            let mut out = Vec::new();
            write_raw(&mut out, &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff], 100)
                .await
                .unwrap();
            let err = read_frame::<_, Msg>(&mut Cursor::new(out), 100)
                .await
                .unwrap_err();
            assert!(err.to_string().starts_with("malformed Msg frame"), "{err}");
            // A header cut short.
            let err = read_frame::<_, Msg>(&mut Cursor::new(vec![5u8, 0]), 100)
                .await
                .unwrap_err();
            assert!(err.to_string().contains("inside a frame header"), "{err}");
        });
    }
}
