//! Reading a rank's output as lines of bounded length: a rank that prints megabytes without a
//! newline (a progress bar's carriage returns, a binary dump) must not make the launcher hold
//! it all in memory.

use std::io::{BufRead, BufReader, ErrorKind, Read};

/// The longest line kept whole; longer ones are cut into pieces of this many bytes.
pub(crate) const MAX_LINE: usize = 64 * 1024;

/// Calls `emit` with each line of `from` (without its `\n`) and whether a `\n` ended it,
/// cutting lines longer than `max` bytes into pieces of `max` bytes: a piece of a line that
/// goes on, or the stream's unterminated last line, comes with `false`. A piece of exactly
/// `max` bytes waits for the next byte, so that a `\n` right after it ends it rather than
/// making a new, empty line. Ends at the end of the stream or at a read error.
pub(crate) fn for_each_line(from: impl Read, max: usize, mut emit: impl FnMut(&[u8], bool)) {
    let max = max.max(1);
    let mut reader = BufReader::new(from);
    let mut line = Vec::new();
    loop {
        let buf = match reader.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        if buf.is_empty() {
            break;
        }
        if line.len() == max {
            let newline = buf[0] == b'\n';
            if newline {
                reader.consume(1);
            }
            emit(&line, newline);
            line.clear();
            continue;
        }
        let room = max - line.len();
        let window = &buf[..buf.len().min(room)];
        match window.iter().position(|&b| b == b'\n') {
            Some(i) => {
                line.extend_from_slice(&window[..i]);
                reader.consume(i + 1);
                emit(&line, true);
                line.clear();
            }
            None => {
                let n = window.len();
                line.extend_from_slice(window);
                reader.consume(n);
            }
        }
    }
    if !line.is_empty() {
        emit(&line, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pieces of `input`, each with a `\n` where one ended it.
    fn lines(input: &[u8], max: usize) -> Vec<String> {
        let mut out = Vec::new();
        for_each_line(input, max, |l, newline| {
            let end = if newline { "\n" } else { "" };
            out.push(format!("{}{end}", String::from_utf8_lossy(l)));
        });
        out
    }

    #[test]
    fn lines_are_split_at_newlines_and_cut_at_the_limit() {
        assert_eq!(lines(b"ab\ncd\n", 8), ["ab\n", "cd\n"]);
        assert_eq!(lines(b"ab\n\ncd", 8), ["ab\n", "\n", "cd"]);
        assert_eq!(
            lines(b"abcdefghij\nk\n", 4),
            ["abcd", "efgh", "ij\n", "k\n"]
        );
        // A line of exactly the limit is one line, not one and an empty one.
        assert_eq!(lines(b"abcd\nef\n", 4), ["abcd\n", "ef\n"]);
        assert_eq!(lines(b"abcdefgh", 4), ["abcd", "efgh"]);
        assert_eq!(lines(b"", 4), Vec::<String>::new());
    }

    #[test]
    fn a_huge_line_is_never_held_whole() {
        let huge = vec![b'x'; 10 * MAX_LINE + 5];
        let mut longest = 0;
        let mut total = 0;
        for_each_line(&huge[..], MAX_LINE, |l, _| {
            longest = longest.max(l.len());
            total += l.len();
        });
        assert_eq!((longest, total), (MAX_LINE, huge.len()));
    }
}
