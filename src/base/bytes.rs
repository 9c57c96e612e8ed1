//! `#[serde(with = "crate::base::bytes")]` for a `Vec<u8>` field: the bytes go as one byte
//! string (serde's `serialize_bytes`), not as a sequence of numbers. In postcard both are
//! the same on the wire (a varint length, then the bytes), so peers of either kind read
//! each other; a byte string is one copy, a sequence a call per byte (a weight chunk's
//! reply spent more time in those calls than in its decoding). JSON writes both as an
//! array of numbers and reads either.

use serde::de::{Error, SeqAccess, Visitor};
use serde::{Deserializer, Serializer};

pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_bytes(v)
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    d.deserialize_byte_buf(Bytes)
}

struct Bytes;

impl<'de> Visitor<'de> for Bytes {
    type Value = Vec<u8>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("bytes")
    }

    fn visit_bytes<E: Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
        Ok(v.to_vec())
    }

    fn visit_byte_buf<E: Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
        Ok(v)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
        // The hint is the sender's claim: capped, the vector grows past it as bytes come.
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
        while let Some(b) = seq.next_element::<u8>()? {
            out.push(b);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Plain(Vec<u8>);

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct AsBytes(#[serde(with = "super")] Vec<u8>);

    #[test]
    fn the_wire_is_the_plain_vectors_in_postcard_and_json() {
        let data: Vec<u8> = (0..=255u8).chain(0..40).collect();
        let plain = postcard::to_allocvec(&Plain(data.clone())).unwrap();
        let bytes = postcard::to_allocvec(&AsBytes(data.clone())).unwrap();
        assert_eq!(plain, bytes);
        assert_eq!(
            postcard::from_bytes::<AsBytes>(&plain).unwrap(),
            AsBytes(data.clone())
        );
        assert_eq!(
            postcard::from_bytes::<Plain>(&bytes).unwrap(),
            Plain(data.clone())
        );
        // JSON: an array of numbers both ways.
        let json = serde_json::to_string(&AsBytes(vec![1, 2, 255])).unwrap();
        assert_eq!(
            json,
            serde_json::to_string(&Plain(vec![1, 2, 255])).unwrap()
        );
        assert_eq!(
            serde_json::from_str::<AsBytes>(&json).unwrap(),
            AsBytes(vec![1, 2, 255])
        );
        // A length claiming more than the frame holds is an error, not a huge allocation.
        let mut lying = postcard::to_allocvec(&AsBytes(vec![7; 3])).unwrap();
        lying[0] = 0xff;
        lying.insert(1, 0x7f);
        assert!(postcard::from_bytes::<AsBytes>(&lying).is_err());
    }
}
