//! Reading a rank's output as lines of bounded length: a rank that prints megabytes without a
//! newline (a progress bar's carriage returns, a binary dump) must not make the launcher hold
//! it all in memory.

use std::io::{BufRead, BufReader, ErrorKind, Read};

/// The longest line kept whole; longer ones are cut into pieces of this many bytes.
pub(crate) const MAX_LINE: usize = 64 * 1024;

/// Calls `emit` with each line of `from` (without its `\n`), cutting lines longer than `max`
/// bytes into pieces of `max` bytes. Ends at the end of the stream or at a read error.
pub(crate) fn for_each_line(from: impl Read, max: usize, mut emit: impl FnMut(&[u8])) {
    let max = max.max(1);
    let mut reader = BufReader::new(from);
    let mut line = Vec::new();
    // A piece was just cut at `max`: a newline right after it ends that line, not a new,
    // empty one.
    let mut just_cut = false;
    loop {
        let buf = match reader.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        if buf.is_empty() {
            if !line.is_empty() {
                emit(&line);
            }
            break;
        }
        if just_cut && buf[0] == b'\n' {
            reader.consume(1);
            just_cut = false;
            continue;
        }
        just_cut = false;
        let room = max - line.len();
        let window = &buf[..buf.len().min(room)];
        match window.iter().position(|&b| b == b'\n') {
            Some(i) => {
                line.extend_from_slice(&window[..i]);
                reader.consume(i + 1);
                emit(&line);
                line.clear();
            }
            None => {
                let n = window.len();
                line.extend_from_slice(window);
                reader.consume(n);
                if line.len() == max {
                    emit(&line);
                    line.clear();
                    just_cut = true;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8], max: usize) -> Vec<String> {
        let mut out = Vec::new();
        for_each_line(input, max, |l| {
            out.push(String::from_utf8_lossy(l).into_owned())
        });
        out
    }

    #[test]
    fn lines_are_split_at_newlines_and_cut_at_the_limit() {
        assert_eq!(lines(b"ab\ncd\n", 8), ["ab", "cd"]);
        assert_eq!(lines(b"ab\n\ncd", 8), ["ab", "", "cd"]);
        assert_eq!(lines(b"abcdefghij\nk\n", 4), ["abcd", "efgh", "ij", "k"]);
        // A line of exactly the limit is one line, not one and an empty one.
        assert_eq!(lines(b"abcd\nef\n", 4), ["abcd", "ef"]);
        assert_eq!(lines(b"", 4), Vec::<String>::new());
    }

    #[test]
    fn a_huge_line_is_never_held_whole() {
        let huge = vec![b'x'; 10 * MAX_LINE + 5];
        let mut longest = 0;
        let mut total = 0;
        for_each_line(&huge[..], MAX_LINE, |l| {
            longest = longest.max(l.len());
            total += l.len();
        });
        assert_eq!((longest, total), (MAX_LINE, huge.len()));
    }
}
