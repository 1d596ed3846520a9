//! Every command ends quietly when its output pipe closes (`oato inspect m.gguf | head`): no
//! panic, no backtrace; the status is success or death by SIGPIPE, as for `cat`.

mod common;

use std::io::Read;
use std::process::Stdio;

use common::{model_path, oato_piped, text};

/// Runs `oato args` with stdout a pipe that is closed after `read` bytes were read (0: at once),
/// and returns its stderr, having checked how it ended.
fn closed_pipe(args: &[&str], read: usize) -> String {
    let mut child = oato_piped(args)
        .stdin(Stdio::null())
        .spawn()
        .expect("the oato binary runs");
    let mut out = child.stdout.take().expect("piped stdout");
    let mut buf = vec![0u8; read];
    out.read_exact(&mut buf).expect("the first bytes of output");
    drop(out);
    let mut err = Vec::new();
    child
        .stderr
        .take()
        .expect("piped stderr")
        .read_to_end(&mut err)
        .expect("stderr readable");
    let status = child.wait().expect("the child ends");
    let err = text(&err);
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(!err.contains("Broken pipe"), "{args:?}: {err}");
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        assert!(
            status.success() || status.signal() == Some(13),
            "{args:?} ended with {status:?}: {err}"
        );
    }
    #[cfg(not(unix))]
    assert!(status.code().is_some(), "{args:?}: {status:?}");
    err
}

#[test]
fn inspect_and_run_end_quietly_when_stdout_closes() {
    let m = model_path();
    let m = m.to_str().unwrap();
    closed_pipe(&["inspect", m], 0);
    closed_pipe(&["inspect", "--json", m], 0);
    closed_pipe(&["inspect", m], 10);
    // Streamed text: the pipe closes after 4 bytes, while tokens are still coming.
    closed_pipe(
        &[
            "run",
            m,
            "-p",
            "Once upon a time",
            "-n",
            "48",
            "-t",
            "1",
            "--temp",
            "0",
            "--ignore-eos",
        ],
        4,
    );
    closed_pipe(&["--help"], 0);
}
