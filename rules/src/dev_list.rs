//! A fixture node's `dev.list`: the device nodes of a fake node, one per line, as
//! `c <major>:<minor> /dev/<path>` (or `b` for a block device); `#` comments and blank lines are
//! ignored. The agent's fixture trees (`devicelet try`, the tests) and the SDK's `FakeHost` read it.

/// Character or block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Char,
    Block,
}

/// One line of a `dev.list`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Where the node is, e.g. `/dev/dri/renderD128`.
    pub path: String,
    pub kind: Kind,
    pub major: u32,
    pub minor: u32,
}

/// Parses a `dev.list`; the error names the line.
pub fn parse(text: &str) -> Result<Vec<Entry>, String> {
    let mut nodes = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let bad = || {
            format!(
                "line {}: expected `c <major>:<minor> /dev/<path>` (or `b`), got {line:?}",
                n + 1
            )
        };
        let parts: Vec<&str> = line.split_whitespace().collect();
        let [kind, numbers, path] = parts.as_slice() else {
            return Err(bad());
        };
        let kind = match *kind {
            "c" => Kind::Char,
            "b" => Kind::Block,
            _ => return Err(bad()),
        };
        let (major, minor) = numbers.split_once(':').ok_or_else(bad)?;
        let (Ok(major), Ok(minor)) = (major.parse(), minor.parse()) else {
            return Err(bad());
        };
        if !path.starts_with("/dev/") || crate::grants::normal(path).is_err() {
            return Err(bad());
        }
        nodes.push(Entry {
            path: (*path).to_owned(),
            kind,
            major,
            minor,
        });
    }
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_and_a_bad_one_is_named() {
        let nodes = parse("# a comment\nc 10:229 /dev/fuse\n\nb 8:0 /dev/sda # disk\n").unwrap();
        assert_eq!(nodes.len(), 2);
        assert_eq!(
            (nodes[1].kind, nodes[1].major, nodes[1].minor),
            (Kind::Block, 8, 0)
        );
        for bad in [
            "x 1:2 /dev/a",
            "c 1 /dev/a",
            "c 1:2 /etc/a",
            "c 1:2 /dev/../etc",
            "c 1:2",
        ] {
            let e = parse(&format!("c 1:1 /dev/ok\n{bad}")).unwrap_err();
            assert!(e.starts_with("line 2:"), "{bad}: {e}");
        }
    }
}
