//! Issue 17: `ember chat` on the bundled demo model (random weights: the words are noise, the
//! mechanics are what is checked). Piped stdin: every line a turn, the commands, and the prompt
//! cache reusing the conversation across turns. In a real terminal (tmux): Ctrl-C stops the
//! answer being written, the conversation and the program go on, and the partial answer is
//! kept in the history.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ember-chat-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `[N prompt tokens, C from the cache | ...]` lines of stderr, as (N, C).
fn turn_stats(stderr: &str) -> Vec<(usize, usize)> {
    stderr
        .lines()
        .filter_map(|l| {
            let l = &l[l.find('[')? + 1..];
            let (n, rest) = l.split_once(" prompt tokens, ")?;
            let (c, _) = rest.split_once(" from the cache")?;
            Some((n.parse().ok()?, c.parse().ok()?))
        })
        .collect()
}

#[test]
fn r17_chat_piped_turns_commands_and_cache() {
    let dir = temp("piped");
    let saved = dir.join("conv.json");
    let script = format!("Hello there\nWhat next?\n/save {0}\n/reset\n/load {0}\nAnd again\n/bogus\n", saved.display());
    let mut child = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(["chat", "-n", "12", "--seed", "1", "-t", "1", "--system", "Be brief."])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(script.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let stats = turn_stats(&stderr);
    assert_eq!(stats.len(), 3, "three answers: {stderr}");
    assert_eq!(stats[0].1, 0, "nothing cached before the first turn");
    // Later turns restore the conversation up to (at least) the end of the previous user
    // message from the prompt cache, also after /reset + /load of the same conversation.
    for (i, &(n, cached)) in stats.iter().enumerate().skip(1) {
        assert!(cached > stats[i - 1].0 / 2 && cached < n, "turn {i}: {cached} of {n} cached; {stderr}");
    }
    assert!(stderr.contains("(saved 5 messages") && stderr.contains("(loaded 5 messages"), "{stderr}");
    assert!(stderr.contains("unknown command /bogus"), "{stderr}");
    let conv: Value = serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    let roles: Vec<&str> = conv["messages"].as_array().unwrap().iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "user", "assistant"]);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Whether the screen shows output after the last line holding `input` (the turn's answer).
fn answer_started(screen: &str, input: &str) -> bool {
    let lines: Vec<&str> = screen.lines().collect();
    lines.iter().rposition(|l| l.contains(input)).is_some_and(|i| lines[i + 1..].iter().any(|l| !l.trim().is_empty()))
}

struct Tmux {
    socket: String,
}

impl Tmux {
    fn cmd(&self, args: &[&str]) -> std::process::Output {
        Command::new("tmux").args(["-L", &self.socket]).args(args).output().expect("run tmux")
    }

    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.cmd(&["capture-pane", "-p", "-t", "chat", "-S", "-200"]).stdout).into_owned()
    }

    /// Waits until the screen satisfies `f`.
    fn wait_for(&self, what: &str, f: impl Fn(&str) -> bool) -> String {
        let t0 = Instant::now();
        loop {
            let s = self.screen();
            if f(&s) {
                return s;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "timed out waiting for {what}; screen:\n{s}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd(&["kill-server"]);
    }
}

#[test]
fn r17_chat_in_a_terminal_ctrl_c_stops_the_answer_only() {
    if Command::new("tmux").arg("-V").output().is_err() {
        assert!(std::env::var_os("CI").is_none(), "CI is set but tmux is not installed");
        eprintln!("SKIPPED r17_chat_in_a_terminal_ctrl_c_stops_the_answer_only: tmux not found");
        return;
    }
    let dir = temp("tmux");
    let saved = dir.join("conv.json");
    let t = Tmux { socket: format!("ember-chat-test-{}", std::process::id()) };
    // Unlimited answers (-n absent, --ignore-eos): only Ctrl-C or the full context ends them
    // (the demo model's random text can sample an end-of-generation token within 100 tokens,
    // before a Ctrl-C sent once the answer shows would land).
    let cmd = format!("{} chat -t 1 --seed 2 -c 4096 --ignore-eos; echo EXITED $?; sleep 30", env!("CARGO_BIN_EXE_ember"));
    let o = t.cmd(&["new-session", "-d", "-s", "chat", "-x", "200", "-y", "50", &cmd]);
    assert!(o.status.success(), "tmux: {}", String::from_utf8_lossy(&o.stderr));
    t.wait_for("the prompt", |s| s.contains("ember chat") && s.trim_end().ends_with('>'));
    t.cmd(&["send-keys", "-t", "chat", "Tell me a long story", "Enter"]);
    // Ctrl-C only once the answer streams (at the prompt it quits): on a loaded machine the
    // turn can take longer than any fixed sleep to start.
    t.wait_for("the answer to start", |s| answer_started(s, "Tell me a long story"));
    std::thread::sleep(Duration::from_millis(200));
    t.cmd(&["send-keys", "-t", "chat", "C-c"]);
    let s = t.wait_for("the answer to stop", |s| s.contains("stopped (Ctrl-C)"));
    assert!(!s.contains("EXITED"), "Ctrl-C during an answer must not quit:\n{s}");
    t.wait_for("the prompt again", |s| s.trim_end().ends_with('>'));
    t.cmd(&["send-keys", "-t", "chat", &format!("/save {}", saved.display()), "Enter"]);
    t.wait_for("the save", |s| s.contains("(saved 2 messages"));
    let conv: Value = serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    let m = &conv["messages"];
    assert_eq!(m[0]["content"], "Tell me a long story");
    assert_eq!(m[1]["role"], "assistant");
    let shown = m[1]["reasoning_content"].as_str().unwrap_or("").len() + m[1]["content"].as_str().unwrap().len();
    assert!(shown > 0, "the partial answer is kept: {conv}");
    // The next turn works and reuses the conversation.
    t.cmd(&["send-keys", "-t", "chat", "Go on", "Enter"]);
    t.wait_for("the second answer to start", |s| answer_started(s, "Go on"));
    std::thread::sleep(Duration::from_millis(100));
    // The demo model (random weights) may end this answer itself (an end-of-generation token:
    // its text depends on where the first answer was cut); Ctrl-C then would reach the prompt
    // and quit. Stop it only while it runs: the first turn has tested the stop.
    if turn_stats(&t.screen()).len() < 2 {
        t.cmd(&["send-keys", "-t", "chat", "C-c"]);
    }
    let s = t.wait_for("the second answer to end", |s| turn_stats(s).len() == 2);
    let stats = turn_stats(&s);
    assert_eq!(stats.len(), 2, "{s}");
    assert!(stats[1].1 > 0, "the second turn restored the first from the prompt cache: {s}");
    // Ctrl-C at the prompt quits.
    t.wait_for("the prompt again", |s| s.trim_end().ends_with('>'));
    t.cmd(&["send-keys", "-t", "chat", "C-c"]);
    let s = t.wait_for("the exit", |s| s.contains("EXITED"));
    assert!(s.contains("EXITED 130"), "{s}");
    std::fs::remove_dir_all(dir).unwrap();
}
