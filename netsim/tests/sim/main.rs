//! netsim's tests (one binary): a small simulated swarm of about 50 peers over
//! internet-like links (`small`), the weight broadcast to 6 followers (`broadcast`), and the training group's protocol in process, in seconds
//! (`member_loop`), and peers behind NAT (`nat`).

mod broadcast;
mod member_loop;
mod nat;
mod small;

/// One test at a time: `small` runs about 50 peers in this process on two cores, and the
/// member loop's rounds have a bound of a few seconds: two at once would make a slow round
/// a test's verdict.
pub async fn one_at_a_time() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}
