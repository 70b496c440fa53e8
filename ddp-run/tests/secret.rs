//! The job's secret: drawn once per job by `ddp_run::launch`, the same on every rank, found
//! in each rank's environment and nowhere on its command line.

use std::path::Path;
use std::time::Duration;

use ddp_run::{launch, LaunchConfig, Outcome};
use ddp_testkit::{procs, temp_dir, wait_for};

const LIMIT: Duration = Duration::from_secs(60);

/// What `/proc` shows of one running rank.
#[derive(Debug)]
struct Seen {
    cmdline: Vec<u8>,
    secret: Option<String>,
}

/// Launches two ranks that write their pid and wait for a go file, reads `/proc` for each
/// while they run, then lets them finish.
fn ranks_of_one_job(dir: &Path) -> Vec<Seen> {
    let script = r#"echo $$ > "$SECRET_TEST_DIR/pid-$RANK.tmp" && mv "$SECRET_TEST_DIR/pid-$RANK.tmp" "$SECRET_TEST_DIR/pid-$RANK"
        while [ ! -e "$SECRET_TEST_DIR/go" ]; do sleep 0.05; done"#;
    let config = LaunchConfig {
        echo: false,
        env: vec![("SECRET_TEST_DIR".into(), dir.into())],
        ..LaunchConfig::new("sh", 2).args(["-c", script])
    };
    let job = std::thread::spawn(move || launch(&config, |_| {}));
    let pids: Vec<u32> = (0..2)
        .map(|rank| {
            let file = dir.join(format!("pid-{rank}"));
            wait_for(&format!("rank {rank}'s pid"), LIMIT, || file.exists());
            std::fs::read_to_string(&file)
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        })
        .collect();
    let seen = pids
        .iter()
        .map(|&pid| Seen {
            cmdline: std::fs::read(format!("/proc/{pid}/cmdline")).unwrap(),
            secret: procs::env_var(pid, "DDP_SECRET"),
        })
        .collect();
    std::fs::write(dir.join("go"), "").unwrap();
    assert_eq!(
        job.join().unwrap().unwrap(),
        Outcome::Succeeded { restarts: 0 }
    );
    seen
}

#[test]
fn each_job_gives_its_ranks_a_fresh_secret_in_the_environment_only() {
    if std::env::var_os("DDP_SECRET").is_some() {
        println!("skipped: DDP_SECRET is set in this environment, so ddp-run passes it on");
        return;
    }
    let (a, b) = (temp_dir("secret-job-a"), temp_dir("secret-job-b"));
    let first = ranks_of_one_job(a.path());
    let second = ranks_of_one_job(b.path());
    for job in [&first, &second] {
        let secret = job[0].secret.clone().expect("rank 0 has DDP_SECRET");
        assert_eq!(secret.len(), 32, "128 bits in hexadecimal");
        assert!(secret.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(job[1].secret.as_ref(), Some(&secret), "one secret per job");
        for rank in job {
            let cmdline = String::from_utf8_lossy(&rank.cmdline);
            assert!(cmdline.starts_with("sh\0-c\0"), "{cmdline:?}");
            assert!(
                !cmdline.contains(&secret),
                "the secret is on the command line"
            );
        }
    }
    assert_ne!(
        first[0].secret, second[0].secret,
        "two jobs got the same secret"
    );
}
