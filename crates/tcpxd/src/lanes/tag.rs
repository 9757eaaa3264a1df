//! A lane's request tags.

/// A lane's request tags: TCPX ignores them (the k-th send meets the k-th receive), so they only
/// number a lane's requests for the plugin's logs, wrapping within `i32`'s positive range.
#[derive(Debug, Default, Clone, Copy)]
pub struct Tag(i32);

impl Tag {
    /// The next tag (the first is 1).
    pub fn advance(&mut self) -> i32 {
        self.0 = self.0.wrapping_add(1) & 0x7fff_ffff;
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::Tag;

    #[test]
    fn tags_count_from_one_and_stay_positive() {
        let mut t = Tag::default();
        assert_eq!((t.advance(), t.advance()), (1, 2));
        let mut t = Tag(i32::MAX - 1);
        assert_eq!(t.advance(), i32::MAX);
        assert_eq!(t.advance(), 0);
        assert_eq!(t.advance(), 1);
    }
}
