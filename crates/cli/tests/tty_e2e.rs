//! `sandman exec -it` as a person uses it: in a real terminal (tmux), against the real server and
//! daemons. Typing reaches the command, the terminal's size and its resizes reach `stty size`,
//! Ctrl-C interrupts the command in the sandbox (not the CLI), and the exit code comes back.
//! Needs tmux (./scripts/test installs it).
#![allow(clippy::unwrap_used)]

mod e2e;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use e2e::{Server, TOKEN, eventually, host, sandman_bin};

/// A tmux server of this test's own (its own socket), killed however the test ends.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn run(&self, args: &[&str]) -> String {
        let out = Command::new("tmux").arg("-L").arg(&self.socket).args(args).output().unwrap_or_else(|e| {
            panic!("cannot run tmux ({e}): install it (Debian: apt-get install tmux; ./scripts/test does)")
        });
        assert!(out.status.success(), "tmux {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn screen(&self) -> String {
        self.run(&["capture-pane", "-p", "-t", "main"])
    }

    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "main"];
        args.extend_from_slice(keys);
        self.run(&args);
    }

    /// The pane's rows and columns, as the command in it should see them.
    fn pane_size(&self) -> String {
        self.run(&["display-message", "-p", "-t", "main", "#{pane_height} #{pane_width}"]).trim().to_string()
    }

    /// Waits until the screen shows `text` (the terminal is external: poll with a deadline).
    async fn shows(&self, text: &str) {
        let found = eventually(Duration::from_secs(20), async || self.screen().contains(text)).await;
        assert!(found, "the terminal never showed `{text}`:\n{}", self.screen());
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux").arg("-L").arg(&self.socket).arg("kill-server").output();
    }
}

#[tokio::test]
async fn exec_it_in_tmux_types_resizes_interrupts_and_exits_with_the_code() {
    let server = Server::start();
    let http = server.client();
    let id = http.create(host()).await["id"].as_str().unwrap().to_string();
    let dir = tempfile::tempdir_in(e2e::scratch()).unwrap();
    let exit_file = dir.path().join("exit");
    let tmux = Tmux { socket: format!("sandman-test-{}", std::process::id()) };
    let script = format!(
        "SANDMAN_URL={url} SANDMAN_TOKEN={TOKEN} {bin} exec -it {id} -- sh; echo $? > {exit}; sleep 60",
        url = server.url,
        bin = sandman_bin().display(),
        exit = exit_file.display(),
    );
    tmux.run(&["-f", "/dev/null", "new-session", "-d", "-s", "main", "-x", "100", "-y", "30", &script]);

    tmux.keys(&["echo rea''dy", "Enter"]);
    tmux.shows("ready").await;
    // The sandbox's shell sees a terminal of the pane's size.
    tmux.keys(&["tty; stty size", "Enter"]);
    tmux.shows("/dev/pts/").await;
    tmux.shows(&tmux.pane_size()).await;
    // A resize of the window reaches the command (SIGWINCH, then the terminal's new size).
    tmux.run(&["resize-window", "-t", "main", "-x", "120", "-y", "40"]);
    let resized = tmux.pane_size();
    assert!(resized.ends_with(" 120"), "{resized}");
    let seen = eventually(Duration::from_secs(20), async || {
        tmux.keys(&["clear; stty size", "Enter"]);
        tokio::time::sleep(Duration::from_millis(200)).await;
        tmux.screen().contains(&resized)
    })
    .await;
    assert!(seen, "`stty size` never showed {resized}:\n{}", tmux.screen());
    // Ctrl-C stops the command in the sandbox; the shell (and the CLI) carry on.
    tmux.keys(&["sleep 100", "Enter"]);
    // Only once it runs: a Ctrl-C the shell takes while it is still reading the line is not
    // the command's (on a loaded machine the keys can arrive together).
    let running = eventually(Duration::from_secs(20), async || {
        http.exec(&id, serde_json::json!({"argv": ["pgrep", "-x", "sleep"]})).await["exit_code"] == 0
    })
    .await;
    assert!(running, "`sleep 100` never started:\n{}", tmux.screen());
    tmux.keys(&["C-c"]);
    tmux.keys(&["echo after''int", "Enter"]);
    tmux.shows("afterint").await;
    tmux.keys(&["exit 7", "Enter"]);
    let exited = eventually(Duration::from_secs(20), async || exit_file.exists()).await;
    assert!(exited, "the CLI did not exit:\n{}", tmux.screen());
    assert_eq!(read(&exit_file).trim(), "7");
    // The process is forgotten once the CLI is done with it.
    let left = http.get(&format!("/v1/sandboxes/{id}/processes")).await.ok();
    assert_eq!(left["processes"].as_array().map(Vec::len), Some(0), "{left}");
    http.release(&id).await;
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}
