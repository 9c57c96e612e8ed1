//! Lower-case hex text of bytes, and back (keys, certificates, ids in files and logs).

/// The bytes as lower-case hex.
pub fn encode(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The bytes of hex text (either case); None unless it is an even number of hex digits.
pub fn decode(t: &str) -> Option<Vec<u8>> {
    if t.len() % 2 != 0 || !t.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    (0..t.len() / 2)
        .map(|i| u8::from_str_radix(&t[2 * i..2 * i + 2], 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn hex_round_trips_and_refuses_what_is_not_hex() {
        let b = [0u8, 1, 0xab, 0xff];
        assert_eq!(super::encode(&b), "0001abff");
        assert_eq!(super::decode("0001ABff").unwrap(), b);
        assert_eq!(super::decode("abc"), None);
        assert_eq!(super::decode("zz"), None);
    }
}
