//! Admission of creates: the global create rate (a token bucket), each job's own create rate and
//! weight, and one bounded queue whose order shares the global rate between the jobs queueing in
//! it by weight (start-time fair queueing). Pure and synchronous: the service's admission task
//! drives it with `tokio::time` instants. Start at [`Admission::offer`] and [`Admission::admit`].
//!
//! Fair share: every tenant (a job, the creates of no job, a pool's refills) has a virtual time,
//! the start tag of its next create. Admitting a create of tenant `t` sets the system virtual
//! time to that tag and advances `t`'s by `1 / weight`; the next token goes to the queueing
//! tenant, whose own rate allows it, with the smallest tag (the older create on a tie). A tenant
//! that starts queueing again starts at the system virtual time, so idling earns no credit.
//! While tenants queue, each gets the global rate in proportion to its weight, less what its
//! own rate caps, which the others share.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

/// A token bucket: `rate` tokens a second, holding at most `burst`.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket. `rate` must be positive; `burst` is at least one token.
    pub fn new(rate: f64, burst: f64, now: Instant) -> Self {
        let burst = burst.max(1.0);
        TokenBucket { rate, burst, tokens: burst, last: now }
    }

    pub fn rate(&self) -> f64 {
        self.rate
    }

    fn refill(&mut self, now: Instant) {
        if now > self.last {
            let earned = (now - self.last).as_secs_f64() * self.rate;
            self.tokens = (self.tokens + earned).min(self.burst);
            self.last = now;
        }
    }

    /// Whether a whole token is there at `now`.
    pub fn has_token(&mut self, now: Instant) -> bool {
        self.refill(now);
        // A hair of tolerance so that a wake-up computed from `ready_at` always finds its token.
        self.tokens >= 1.0 - 1e-9
    }

    /// Takes a token if there is one.
    pub fn try_take(&mut self, now: Instant) -> bool {
        if self.has_token(now) {
            self.tokens = (self.tokens - 1.0).max(0.0);
            true
        } else {
            false
        }
    }

    /// When the next whole token will be there (`now` when it is).
    pub fn ready_at(&mut self, now: Instant) -> Instant {
        self.refill(now);
        if self.tokens >= 1.0 - 1e-9 {
            return now;
        }
        let wait = (1.0 - self.tokens) / self.rate;
        // Round up to the next microsecond so that the token is whole when we wake.
        now + Duration::from_micros((wait * 1e6).ceil() as u64)
    }
}

/// Who a create counts for in admission.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tenant {
    Job(String),
    /// Creates that name no job.
    NoJob,
    /// A pool's refills, counted against no job.
    Pool(String),
}

impl Tenant {
    pub fn of_job(job: Option<&str>) -> Tenant {
        job.map_or(Tenant::NoJob, |j| Tenant::Job(j.to_string()))
    }
}

/// One queued create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    /// The sandbox it creates.
    pub id: String,
    pub enqueued: Instant,
    /// Arrival order, for ties.
    seq: u64,
    /// The position it was last told (see [`Admission::progress`]).
    reported: u64,
}

/// What became of an offered create.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Offer {
    /// Admitted at once: nothing was queueing and the rates allowed it.
    Admitted,
    /// Queued; about `position` creates go first (1 = next), admitted in about `wait`.
    Queued { position: u64, wait: Option<Duration> },
    /// The queue is at its bound; retry after about this long.
    Full { retry_after: Duration },
}

#[derive(Debug)]
struct Flow {
    weight: f64,
    /// The tenant's own create rate, when it has one.
    bucket: Option<TokenBucket>,
    /// Start tag of the head of `queue` (or of the next create, when empty).
    vtime: f64,
    queue: VecDeque<Ticket>,
}

impl Flow {
    fn new(weight: f64) -> Self {
        Flow { weight, bucket: None, vtime: 0.0, queue: VecDeque::new() }
    }

    /// What [`ahead_of`] needs of a tenant's flow.
    fn shape<'a>((tenant, flow): (&'a Tenant, &Flow)) -> (&'a Tenant, f64, f64, usize) {
        (tenant, flow.vtime, flow.weight, flow.queue.len())
    }
}

/// The admission state: buckets, tenants and the queue.
#[derive(Debug)]
pub struct Admission {
    /// The global create rate; `None` = unlimited.
    global: Option<TokenBucket>,
    max_queue: usize,
    flows: HashMap<Tenant, Flow>,
    /// Sandbox id → the tenant whose queue holds it.
    queued_in: HashMap<String, Tenant>,
    /// System virtual time: the start tag of the last admitted create.
    vtime: f64,
    seq: u64,
}

impl Admission {
    /// `rate` creates a second overall (`None`: unlimited) with bursts of `burst`, and at most
    /// `max_queue` creates waiting.
    pub fn new(rate: Option<f64>, burst: f64, max_queue: usize, now: Instant) -> Self {
        Admission {
            global: rate.filter(|r| *r > 0.0 && r.is_finite()).map(|r| TokenBucket::new(r, burst, now)),
            max_queue,
            flows: HashMap::new(),
            queued_in: HashMap::new(),
            vtime: 0.0,
            seq: 0,
        }
    }

    /// The global rate, when there is one.
    pub fn rate(&self) -> Option<f64> {
        self.global.as_ref().map(TokenBucket::rate)
    }

    pub fn max_queue(&self) -> usize {
        self.max_queue
    }

    /// Creates waiting.
    pub fn queued(&self) -> usize {
        self.queued_in.len()
    }

    /// Sets a tenant's weight (default 1) and own create rate (`None`: only the global one).
    /// Its bucket holds one second of its rate (at least one create).
    pub fn set_tenant(&mut self, tenant: Tenant, weight: Option<f64>, rate: Option<f64>, now: Instant) {
        let flow = self.flows.entry(tenant).or_insert_with(|| Flow::new(1.0));
        flow.weight = weight.filter(|w| *w > 0.0 && w.is_finite()).unwrap_or(1.0);
        let rate = rate.filter(|r| *r > 0.0 && r.is_finite());
        match (&mut flow.bucket, rate) {
            (Some(b), Some(r)) if b.rate == r => {}
            (_, Some(r)) => flow.bucket = Some(TokenBucket::new(r, r, now)),
            (_, None) => flow.bucket = None,
        }
    }

    /// Forgets a tenant; answers the ids of the creates it had queued, in queue order.
    pub fn remove_tenant(&mut self, tenant: &Tenant) -> Vec<String> {
        let Some(flow) = self.flows.remove(tenant) else { return Vec::new() };
        let ids: Vec<String> = flow.queue.into_iter().map(|t| t.id).collect();
        for id in &ids {
            self.queued_in.remove(id);
        }
        ids
    }

    /// Offers a create: admitted at once, queued, or refused because the queue is full.
    pub fn offer(&mut self, tenant: Tenant, id: &str, now: Instant) -> Offer {
        let vtime = self.vtime;
        let nothing_queued = self.queued_in.is_empty();
        let flow = self.flows.entry(tenant.clone()).or_insert_with(|| Flow::new(1.0));
        if nothing_queued
            && self.global.as_mut().is_none_or(|g| g.has_token(now))
            && flow.bucket.as_mut().is_none_or(|b| b.has_token(now))
        {
            if let Some(g) = self.global.as_mut() {
                g.try_take(now);
            }
            if let Some(b) = flow.bucket.as_mut() {
                b.try_take(now);
            }
            let start = flow.vtime.max(vtime);
            self.vtime = start;
            flow.vtime = start + 1.0 / flow.weight;
            return Offer::Admitted;
        }
        if self.queued_in.len() >= self.max_queue {
            let rate = self.global.as_ref().map_or(1.0, TokenBucket::rate).max(1e-3);
            let drain = Duration::from_secs_f64((self.queued_in.len() as f64 / rate).clamp(1.0, 3600.0));
            return Offer::Full { retry_after: drain };
        }
        if flow.queue.is_empty() {
            flow.vtime = flow.vtime.max(vtime);
        }
        self.seq += 1;
        flow.queue.push_back(Ticket { id: id.to_string(), enqueued: now, seq: self.seq, reported: u64::MAX });
        self.queued_in.insert(id.to_string(), tenant.clone());
        let (position, wait) = self.estimate(&tenant);
        if let Some(t) = self.flows.get_mut(&tenant).and_then(|f| f.queue.back_mut()) {
            t.reported = position;
        }
        Offer::Queued { position, wait }
    }

    /// Queued creates whose place moved enough since they were last told (halfway to the front,
    /// or any move in the last three places), with their new place and wait: each create hears
    /// about log2(position) times, not once per admission (and, as the admission task calls
    /// this at most once a second, never more often than that). Costs one pass over the queue.
    pub fn progress(&mut self) -> Vec<(String, Tenant, u64, Option<Duration>)> {
        // The other tenants as they stand, taken apart from the queues walked (and updated) below.
        let flows: Vec<(Tenant, f64, f64, usize)> =
            self.flows.iter().map(|(t, f)| (t.clone(), f.vtime, f.weight, f.queue.len())).collect();
        let global = self.global.as_ref().map(TokenBucket::rate);
        let mut out = Vec::new();
        for (tenant, flow) in self.flows.iter_mut() {
            let own = flow.bucket.as_ref().map(TokenBucket::rate);
            for (k, ticket) in flow.queue.iter_mut().enumerate() {
                let others = flows.iter().map(|(t, v, w, n)| (t, *v, *w, *n));
                let ahead = ahead_of(tenant, flow.vtime, flow.weight, k, others);
                let position = ahead as u64 + 1;
                let moved = position < ticket.reported && (position <= 3 || position * 2 <= ticket.reported);
                if moved {
                    ticket.reported = position;
                    out.push((ticket.id.clone(), tenant.clone(), position, wait_for(ahead, k, global, own)));
                }
            }
        }
        out
    }

    /// Where the last create of `tenant`'s queue stands: about how many creates are admitted
    /// before it (itself included), and about when it is admitted.
    fn estimate(&self, tenant: &Tenant) -> (u64, Option<Duration>) {
        let Some(flow) = self.flows.get(tenant) else { return (0, None) };
        let k = flow.queue.len().saturating_sub(1);
        let ahead = ahead_of(tenant, flow.vtime, flow.weight, k, self.flows.iter().map(Flow::shape));
        let wait = wait_for(
            ahead,
            k,
            self.global.as_ref().map(TokenBucket::rate),
            flow.bucket.as_ref().map(TokenBucket::rate),
        );
        (ahead as u64 + 1, wait)
    }

    /// Takes a queued create off the queue; false when it is not queued (it was admitted, or
    /// never queued).
    pub fn remove(&mut self, id: &str) -> bool {
        let Some(tenant) = self.queued_in.remove(id) else { return false };
        if let Some(flow) = self.flows.get_mut(&tenant)
            && let Some(i) = flow.queue.iter().position(|t| t.id == id)
        {
            flow.queue.remove(i);
        }
        true
    }

    /// Admits every queued create the rates allow at `now`, in fair order; answers them and
    /// when to look again (`None`: nothing is queued, wait for an offer).
    pub fn admit(&mut self, now: Instant) -> (Vec<(Tenant, Ticket)>, Option<Instant>) {
        let mut out = Vec::new();
        loop {
            if self.queued_in.is_empty() {
                return (out, None);
            }
            if let Some(g) = self.global.as_mut()
                && !g.has_token(now)
            {
                return (out, Some(g.ready_at(now)));
            }
            let mut best: Option<(&Tenant, f64, u64)> = None;
            let mut next_own: Option<Instant> = None;
            for (tenant, flow) in self.flows.iter_mut() {
                let Some(head) = flow.queue.front() else { continue };
                let head_seq = head.seq;
                if let Some(b) = flow.bucket.as_mut()
                    && !b.has_token(now)
                {
                    let at = b.ready_at(now);
                    next_own = Some(next_own.map_or(at, |n| n.min(at)));
                    continue;
                }
                let better = match best {
                    None => true,
                    Some((_, v, s)) => flow.vtime < v || (flow.vtime == v && head_seq < s),
                };
                if better {
                    best = Some((tenant, flow.vtime, head_seq));
                }
            }
            let Some((tenant, _, _)) = best else { return (out, next_own) };
            let tenant = tenant.clone();
            let Some(flow) = self.flows.get_mut(&tenant) else { return (out, next_own) };
            let Some(ticket) = flow.queue.pop_front() else { return (out, next_own) };
            if let Some(b) = flow.bucket.as_mut() {
                b.try_take(now);
            }
            if let Some(g) = self.global.as_mut() {
                g.try_take(now);
            }
            self.vtime = flow.vtime;
            flow.vtime += 1.0 / flow.weight;
            self.queued_in.remove(&ticket.id);
            out.push((tenant, ticket));
        }
    }
}

/// About how many creates are admitted before the `k`-th of `tenant`'s queue (its own `k`
/// before it, and each other tenant's whose start tags come first): `flows` is every tenant's
/// (tenant, start tag of its head, weight, queue length).
fn ahead_of<'a>(
    tenant: &Tenant,
    vtime: f64,
    weight: f64,
    k: usize,
    flows: impl Iterator<Item = (&'a Tenant, f64, f64, usize)>,
) -> f64 {
    let k = k as f64;
    let tag = vtime + k / weight;
    let mut ahead = k;
    for (t, other_vtime, other_weight, len) in flows {
        if t == tenant || len == 0 {
            continue;
        }
        let before = ((tag - other_vtime) * other_weight).ceil().max(0.0);
        ahead += before.min(len as f64);
    }
    ahead
}

/// About how long until a create with `ahead` creates before it overall, `k` of them its own
/// tenant's, is admitted, from the global rate and the tenant's own.
fn wait_for(ahead: f64, k: usize, global: Option<f64>, own: Option<f64>) -> Option<Duration> {
    let global = global.map(|r| (ahead + 1.0) / r);
    let own = own.map(|r| (k as f64 + 1.0) / r);
    let wait = match (global, own) {
        (Some(g), Some(o)) => Some(g.max(o)),
        (g, o) => g.or(o),
    };
    wait.map(|s| Duration::from_secs_f64(s.min(1e6)))
}

/// Creates admitted over the last few seconds, for the achieved-rate gauge.
#[derive(Debug)]
pub struct RateMeter {
    origin: Instant,
    /// (whole second since `origin`, creates admitted in it), oldest first.
    buckets: VecDeque<(u64, u64)>,
}

/// The window the achieved rate is measured over.
pub const METER_WINDOW_S: u64 = 10;

impl RateMeter {
    pub fn new(now: Instant) -> Self {
        RateMeter { origin: now, buckets: VecDeque::new() }
    }

    pub fn add(&mut self, now: Instant, n: u64) {
        let sec = (now - self.origin).as_secs();
        match self.buckets.back_mut() {
            Some((s, count)) if *s == sec => *count += n,
            _ => self.buckets.push_back((sec, n)),
        }
        self.trim(sec);
    }

    fn trim(&mut self, sec: u64) {
        while self.buckets.front().is_some_and(|(s, _)| s + METER_WINDOW_S <= sec) {
            self.buckets.pop_front();
        }
    }

    /// Creates a second over the last [`METER_WINDOW_S`] whole seconds.
    pub fn rate(&mut self, now: Instant) -> f64 {
        let sec = (now - self.origin).as_secs();
        self.trim(sec);
        let done: u64 = self.buckets.iter().filter(|(s, _)| *s < sec).map(|(_, n)| n).sum();
        let span = sec.clamp(1, METER_WINDOW_S - 1);
        done as f64 / span as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(name: &str) -> Tenant {
        Tenant::Job(name.into())
    }

    #[tokio::test(start_paused = true)]
    async fn the_bucket_allows_its_burst_then_its_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(10.0, 5.0, t0);
        assert_eq!((0..8).filter(|_| b.try_take(t0)).count(), 5);
        assert_eq!(b.ready_at(t0), t0 + Duration::from_millis(100));
        tokio::time::advance(Duration::from_millis(99)).await;
        assert!(!b.try_take(Instant::now()));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(b.try_take(Instant::now()));
        // Over 10 s it gives 100 more, and never more than its burst at once.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!((0..100).filter(|_| b.try_take(Instant::now())).count(), 5);
    }

    /// Runs admission for `secs` seconds on the paused clock, waking when it says; answers how
    /// many of each tenant were admitted.
    async fn run(adm: &mut Admission, secs: u64) -> HashMap<Tenant, usize> {
        let end = Instant::now() + Duration::from_secs(secs);
        let mut got: HashMap<Tenant, usize> = HashMap::new();
        loop {
            let (out, next) = adm.admit(Instant::now());
            for (t, _) in out {
                *got.entry(t).or_default() += 1;
            }
            match next {
                Some(at) if at < end => tokio::time::sleep_until(at).await,
                _ => break,
            }
        }
        got
    }

    #[tokio::test(start_paused = true)]
    async fn weights_one_and_three_share_the_rate_one_to_three() {
        let now = Instant::now();
        let mut adm = Admission::new(Some(100.0), 1.0, 100_000, now);
        adm.set_tenant(job("a"), Some(1.0), None, now);
        adm.set_tenant(job("b"), Some(3.0), None, now);
        // Both queue far more than 10 s can admit.
        for i in 0..3000 {
            for t in ["a", "b"] {
                assert!(!matches!(adm.offer(job(t), &format!("{t}{i}"), now), Offer::Full { .. }));
            }
        }
        let got = run(&mut adm, 10).await;
        let (a, b) = (got[&job("a")] as f64, got[&job("b")] as f64);
        // The global rate is held: 1 at once, then 100/s.
        assert!((a + b - 1000.0).abs() <= 2.0, "admitted {}", a + b);
        let ratio = b / a;
        assert!((ratio - 3.0).abs() / 3.0 < 0.10, "b/a = {ratio} ({a} vs {b})");
    }

    #[tokio::test(start_paused = true)]
    async fn a_capped_tenant_leaves_its_share_to_the_others() {
        let now = Instant::now();
        let mut adm = Admission::new(Some(100.0), 1.0, 100_000, now);
        adm.set_tenant(job("slow"), Some(10.0), Some(5.0), now);
        for i in 0..2000 {
            adm.offer(job("slow"), &format!("s{i}"), now);
            adm.offer(job("fast"), &format!("f{i}"), now);
        }
        let got = run(&mut adm, 10).await;
        let slow = got[&job("slow")];
        assert!((50..=56).contains(&slow), "the capped job got {slow} in 10 s at 5/s");
        assert!(got[&job("fast")] >= 940, "{got:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_tenant_earns_no_credit() {
        let now = Instant::now();
        let mut adm = Admission::new(Some(10.0), 1.0, 100_000, now);
        for i in 0..200 {
            adm.offer(job("busy"), &format!("b{i}"), now);
        }
        run(&mut adm, 10).await;
        // A job that starts queueing now shares evenly from here on; it does not get the
        // 10 s it was idle back as a burst.
        for i in 0..200 {
            adm.offer(job("late"), &format!("l{i}"), Instant::now());
        }
        let got = run(&mut adm, 4).await;
        let (busy, late) = (got.get(&job("busy")).copied().unwrap_or(0), got[&job("late")]);
        assert!(busy.abs_diff(late) <= 2, "busy {busy}, late {late}");
    }

    #[tokio::test(start_paused = true)]
    async fn the_queue_is_bounded_and_creates_come_off_it() {
        let now = Instant::now();
        let mut adm = Admission::new(Some(10.0), 1.0, 3, now);
        assert_eq!(adm.offer(Tenant::NoJob, "x0", now), Offer::Admitted);
        for i in 1..4 {
            assert!(matches!(adm.offer(Tenant::NoJob, &format!("x{i}"), now), Offer::Queued { .. }));
        }
        match adm.offer(Tenant::NoJob, "x4", now) {
            Offer::Full { retry_after } => assert!(retry_after >= Duration::from_secs(1)),
            other => panic!("expected full, got {other:?}"),
        }
        assert!(adm.remove("x2"));
        assert!(!adm.remove("x2"));
        assert_eq!(adm.queued(), 2);
        let (out, next) = adm.admit(now);
        assert!(out.is_empty());
        assert_eq!(next, Some(now + Duration::from_millis(100)));
        // A burst of one: a quiet second earns one token, not ten.
        tokio::time::advance(Duration::from_secs(1)).await;
        let (out, next) = adm.admit(Instant::now());
        let ids: Vec<&str> = out.iter().map(|(_, t)| t.id.as_str()).collect();
        assert_eq!((ids, next), (vec!["x1"], Some(Instant::now() + Duration::from_millis(100))));
        tokio::time::advance(Duration::from_millis(100)).await;
        let (out, next) = adm.admit(Instant::now());
        let ids: Vec<&str> = out.iter().map(|(_, t)| t.id.as_str()).collect();
        assert_eq!((ids, next), (vec!["x3"], None));
    }

    #[tokio::test(start_paused = true)]
    async fn a_removed_tenant_takes_its_queue_with_it() {
        let now = Instant::now();
        let mut adm = Admission::new(Some(1.0), 1.0, 100, now);
        adm.offer(job("a"), "a0", now);
        adm.offer(job("a"), "a1", now);
        adm.offer(job("b"), "b0", now);
        assert_eq!(adm.remove_tenant(&job("a")), vec!["a1".to_string()]);
        assert_eq!(adm.queued(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn queue_position_and_wait_follow_the_weights() {
        let now = Instant::now();
        let mut adm = Admission::new(Some(10.0), 1.0, 1000, now);
        adm.set_tenant(job("heavy"), Some(3.0), None, now);
        assert_eq!(adm.offer(job("x"), "first", now), Offer::Admitted);
        for i in 0..30 {
            adm.offer(job("light"), &format!("l{i}"), now);
        }
        // The heavy job's first create goes ahead of almost all the light job's backlog.
        match adm.offer(job("heavy"), "h0", now) {
            Offer::Queued { position, wait } => {
                assert!(position <= 2, "position {position}");
                assert!(wait.is_some_and(|w| w <= Duration::from_millis(300)), "{wait:?}");
            }
            other => panic!("{other:?}"),
        }
        match adm.offer(job("light"), "l30", now) {
            Offer::Queued { position, wait } => {
                assert_eq!(position, 32);
                assert_eq!(wait, Some(Duration::from_millis(3200)));
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_meter_reports_the_recent_rate() {
        let mut m = RateMeter::new(Instant::now());
        for _ in 0..20 {
            m.add(Instant::now(), 50);
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        assert_eq!(m.rate(Instant::now()), 50.0);
        tokio::time::advance(Duration::from_secs(30)).await;
        assert_eq!(m.rate(Instant::now()), 0.0);
    }
}
