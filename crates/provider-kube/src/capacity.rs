//! Capacity-aware admission: how much room the nodes that may run sandboxes have, and a gate that
//! lets creates through as room appears instead of making pods the scheduler cannot place. Start
//! at [`Admission`]; [`Room`] is the arithmetic over Node and Pod objects as watches hold them.
//!
//! A create that fits an eligible node is admitted and counted on that node (as the scheduler's
//! own cache assumes a pod) until its pod is seen bound, however many such pods the scheduler
//! has yet to bind: a burst on a roomy cluster is not held back. One that fits none now is
//! admitted too, its pod left pending so that a cluster autoscaler sees the demand and adds
//! nodes, while fewer than `max_pending` admitted creates are pending so: the API server never
//! holds more sandbox pods that no node has room for than that. The rest wait here with their
//! position and what they wait for. Only a request no eligible node could
//! hold even empty (bigger than the largest node) is refused at once; a wait longer than its
//! deadline ends `unschedulable` too.
//!
//! Fair shares: the waiting creates go in the order of their [`Tenant`]'s share of the room,
//! least first. A tenant's share is the room its sandboxes hold (bound pods as the watch sees
//! them, and its admitted creates not yet bound), as the dominant fraction of the eligible
//! nodes' allocatable (the largest of cpu, memory and pods), divided by its weight; each create
//! let through adds its ask to its tenant's share. So a job that arrives while another holds
//! the nodes gets the room that frees until their shares are even, and two jobs waiting together
//! share it by weight. Within a tenant, first come first served. A warm pool's refills go last,
//! after every other waiting create: a pool is kept ready with room nobody waits for.

use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::fmt;
use std::sync::{Mutex, PoisonError};

use k8s_openapi::api::core::v1::{Container, Node, Pod};
use sandman_wire::server::Quantity;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::KubeConfig;
use crate::pod::{LABEL_INSTANCE, LABEL_JOB, LABEL_MANAGED_BY, LABEL_POOL, MANAGED_BY, label_value};

/// What a pod asks the scheduler for, as the scheduler counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ask {
    pub cpu_milli: u64,
    pub memory: u64,
    pub pods: u64,
}

/// A resource a node can be short of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    Cpu,
    Memory,
    Pods,
    /// No node may run sandboxes at all (none ready, or none matching the selector).
    Nodes,
    /// Behind another waiting create (what the first in line waits for is not known yet).
    Scheduler,
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Resource::Cpu => "cpu",
            Resource::Memory => "memory",
            Resource::Pods => "pods",
            Resource::Nodes => "an eligible node",
            Resource::Scheduler => "the scheduler to place the pending pods",
        })
    }
}

/// Whose share a create's room counts against.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tenant {
    /// A job (its name as the pods' job label has it).
    Job(String),
    /// Creates that name no job.
    NoJob,
    /// A warm pool's refills (unclaimed pool sandboxes): they go after every other waiting create.
    Refill,
}

impl Tenant {
    /// Whose create `spec` is.
    pub fn of_spec(spec: &sandman_provider::SandboxSpec) -> Tenant {
        match &spec.job {
            Some(job) => Tenant::Job(label_value(job)),
            None if spec.labels.contains_key(sandman_provider::POOL_LABEL) => Tenant::Refill,
            None => Tenant::NoJob,
        }
    }

    /// Whose sandbox the pod is, from its labels (a claimed pool sandbox is its claimer's).
    pub fn of_pod(pod: &Pod) -> Tenant {
        let labels = pod.metadata.labels.as_ref();
        match (labels.and_then(|l| l.get(LABEL_JOB)), labels.is_some_and(|l| l.contains_key(LABEL_POOL))) {
            (Some(job), _) => Tenant::Job(job.clone()),
            (None, true) => Tenant::Refill,
            (None, false) => Tenant::NoJob,
        }
    }
}

/// The room each tenant's sandboxes hold: the requests of the provider's own pods bound to a node
/// and not ended, by tenant.
pub type Held = BTreeMap<Tenant, Ask>;

/// What the provider's own pods (this namespace and instance) bound to a node hold, by tenant.
pub fn held<'a>(pods: impl IntoIterator<Item = &'a Pod>, config: &KubeConfig) -> Held {
    let instance = label_value(&config.instance);
    let mut held = Held::new();
    for pod in pods {
        let labels = pod.metadata.labels.as_ref();
        let ours = pod.metadata.namespace.as_deref() == Some(config.namespace.as_str())
            && labels.and_then(|l| l.get(LABEL_MANAGED_BY)).is_some_and(|v| v == MANAGED_BY)
            && labels.and_then(|l| l.get(LABEL_INSTANCE)) == Some(&instance);
        let bound = pod.spec.as_ref().is_some_and(|s| s.node_name.is_some());
        let ended = matches!(pod.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed"));
        if ours && bound && !ended {
            let t = held.entry(Tenant::of_pod(pod)).or_default();
            *t = t.plus(&Ask::of_pod(pod));
        }
    }
    held
}

impl Ask {
    /// The pod's effective requests: per resource, the larger of its containers' sum and its
    /// largest init container (init containers run one at a time, before the others).
    pub fn of_pod(pod: &Pod) -> Ask {
        let Some(spec) = pod.spec.as_ref() else { return Ask { pods: 1, ..Ask::default() } };
        let sum = spec.containers.iter().map(requests).fold(Ask::default(), |a, b| Ask {
            cpu_milli: a.cpu_milli + b.cpu_milli,
            memory: a.memory + b.memory,
            pods: 0,
        });
        let init = spec.init_containers.iter().flatten().map(requests).fold(Ask::default(), |a, b| Ask {
            cpu_milli: a.cpu_milli.max(b.cpu_milli),
            memory: a.memory.max(b.memory),
            pods: 0,
        });
        Ask { cpu_milli: sum.cpu_milli.max(init.cpu_milli), memory: sum.memory.max(init.memory), pods: 1 }
    }

    /// The first resource `free` has too little of for this ask.
    fn short_of(&self, free: &Ask) -> Option<Resource> {
        if self.cpu_milli > free.cpu_milli {
            Some(Resource::Cpu)
        } else if self.memory > free.memory {
            Some(Resource::Memory)
        } else if self.pods > free.pods {
            Some(Resource::Pods)
        } else {
            None
        }
    }

    /// The largest fraction of `total` this ask takes, over cpu, memory and pods (a pod when
    /// nothing is known of the nodes).
    fn dominant(&self, total: &Ask) -> f64 {
        if *total == Ask::default() {
            return self.pods as f64;
        }
        let part = |a: u64, t: u64| if t == 0 { 0.0 } else { a as f64 / t as f64 };
        part(self.cpu_milli, total.cpu_milli).max(part(self.memory, total.memory)).max(part(self.pods, total.pods))
    }

    fn plus(&self, o: &Ask) -> Ask {
        Ask { cpu_milli: self.cpu_milli + o.cpu_milli, memory: self.memory + o.memory, pods: self.pods + o.pods }
    }

    fn minus(&self, o: &Ask) -> Ask {
        Ask {
            cpu_milli: self.cpu_milli.saturating_sub(o.cpu_milli),
            memory: self.memory.saturating_sub(o.memory),
            pods: self.pods.saturating_sub(o.pods),
        }
    }
}

fn requests(c: &Container) -> Ask {
    let get = |name: &str| {
        c.resources.as_ref().and_then(|r| r.requests.as_ref()).and_then(|r| r.get(name)).map(|q| q.0.clone())
    };
    Ask {
        cpu_milli: get("cpu").map_or(0, |q| quantity(&q, 1000.0)),
        memory: get("memory").map_or(0, |q| quantity(&q, 1.0)),
        pods: 0,
    }
}

/// A Kubernetes quantity in units of `1/scale` of its base unit (millicores: 1000), rounded up.
fn quantity(q: &str, scale: f64) -> u64 {
    Quantity::Text(q.to_string()).value().map_or(0, |v| (v * scale).ceil().max(0.0) as u64)
}

/// One eligible node: what it offers and what the pods bound to it request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRoom {
    pub name: String,
    pub allocatable: Ask,
    pub requested: Ask,
}

impl NodeRoom {
    fn free(&self) -> Ask {
        self.allocatable.minus(&self.requested)
    }
}

/// Where a request fits now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fit {
    /// On this node.
    Node(String),
    /// On none now; it would on an empty one. The resource the roomiest node lacks.
    Wait(Resource),
    /// On no eligible node even empty: it can never be scheduled.
    Never { largest: String, resource: Resource },
}

/// The room of the nodes that may run sandboxes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Room {
    pub nodes: Vec<NodeRoom>,
}

impl Room {
    /// The room of the eligible nodes (Ready, schedulable, matching the provider's node
    /// selector, every NoSchedule/NoExecute taint tolerated), less what every pod bound to them
    /// and not ended requests, whoever made it.
    pub fn observe<'a>(
        nodes: impl IntoIterator<Item = &'a Node>,
        pods: impl IntoIterator<Item = &'a Pod>,
        config: &KubeConfig,
    ) -> Room {
        let mut room: BTreeMap<String, NodeRoom> = nodes
            .into_iter()
            .filter(|n| eligible(n, config))
            .map(|n| {
                let name = n.metadata.name.clone().unwrap_or_default();
                let alloc = n.status.as_ref().and_then(|s| s.allocatable.as_ref());
                let get = |k: &str, scale: f64| alloc.and_then(|a| a.get(k)).map_or(0, |q| quantity(&q.0, scale));
                let allocatable =
                    Ask { cpu_milli: get("cpu", 1000.0), memory: get("memory", 1.0), pods: get("pods", 1.0) };
                (name.clone(), NodeRoom { name, allocatable, requested: Ask::default() })
            })
            .collect();
        for pod in pods {
            let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            if matches!(phase, Some("Succeeded" | "Failed")) {
                continue;
            }
            let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_ref()).and_then(|n| room.get_mut(n)) else {
                continue;
            };
            node.requested = node.requested.plus(&Ask::of_pod(pod));
        }
        Room { nodes: room.into_values().collect() }
    }

    /// [`Fit::Never`] when no eligible node could hold `ask` even empty (and some node is
    /// known).
    fn never(&self, ask: &Ask) -> Option<Fit> {
        let largest =
            self.nodes.iter().max_by_key(|n| (n.allocatable.cpu_milli, n.allocatable.memory, n.name.clone()))?;
        if self.nodes.iter().all(|n| ask.short_of(&n.allocatable).is_some()) {
            let resource = ask.short_of(&largest.allocatable).unwrap_or(Resource::Cpu);
            return Some(Fit::Never { largest: largest.name.clone(), resource });
        }
        None
    }

    /// Where `ask` fits: the eligible node with the most cpu left that holds it.
    pub fn fit(&self, ask: &Ask) -> Fit {
        let roomiest = |nodes: &mut dyn Iterator<Item = &NodeRoom>| {
            nodes.max_by_key(|n| (n.free().cpu_milli, n.free().memory, std::cmp::Reverse(n.name.clone()))).cloned()
        };
        if let Some(n) = roomiest(&mut self.nodes.iter().filter(|n| ask.short_of(&n.free()).is_none())) {
            return Fit::Node(n.name);
        }
        if self.nodes.is_empty() {
            return Fit::Wait(Resource::Nodes);
        }
        if let Some(never) = self.never(ask) {
            return never;
        }
        let short = roomiest(&mut self.nodes.iter()).and_then(|n| ask.short_of(&n.free()));
        Fit::Wait(short.unwrap_or(Resource::Cpu))
    }

    /// What the eligible nodes offer together.
    fn total(&self) -> Ask {
        self.nodes.iter().fold(Ask::default(), |t, n| t.plus(&n.allocatable))
    }

    /// Whether `node` is eligible and has room for `ask` now.
    fn holds(&self, node: &str, ask: &Ask) -> bool {
        self.nodes.iter().any(|n| n.name == node && ask.short_of(&n.free()).is_none())
    }

    fn take(&mut self, node: &str, ask: &Ask) {
        if let Some(n) = self.nodes.iter_mut().find(|n| n.name == node) {
            n.requested = n.requested.plus(ask);
        }
    }

    fn describe(&self, name: &str) -> String {
        match self.nodes.iter().find(|n| n.name == name) {
            Some(n) => format!(
                "`{}` ({} cpu, {} memory, {} pods allocatable)",
                n.name,
                n.allocatable.cpu_milli as f64 / 1000.0,
                n.allocatable.memory,
                n.allocatable.pods
            ),
            None => format!("`{name}`"),
        }
    }
}

/// Whether the provider's pods may run on `node`: Ready, schedulable, labelled as the node
/// selector asks, and every NoSchedule/NoExecute taint tolerated.
pub fn eligible(node: &Node, config: &KubeConfig) -> bool {
    let labels = node.metadata.labels.as_ref();
    let selected = config.node_selector.iter().all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v));
    // Ready, not cordoned and the taints tolerated: `prepare` asks the same of a node.
    selected && crate::prepare::eligible(node, &config.tolerations).is_ok()
}

/// Where a create waits: its place in the queue (0: next) and what it waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiting {
    pub position: usize,
    pub resource: Resource,
}

impl fmt::Display for Waiting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "waiting for capacity ({}), position {} in the queue", self.resource, self.position + 1)
    }
}

/// Why a create was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    /// No eligible node could hold the request even empty.
    #[error(
        "the request ({cpu} cpu, {memory} bytes of memory) is more {resource} than the largest eligible node {node} has"
    )]
    NeverFits { resource: Resource, node: String, cpu: String, memory: u64 },
    /// It waited for room until its deadline.
    #[error("no room on the eligible nodes before the wait's deadline: still waiting for capacity ({resource})")]
    TimedOut { resource: Resource },
    /// The API server refuses the watches that tell the room (and no room was seen before).
    #[error(
        "capacity-aware admission cannot watch the cluster's nodes and pods: {why}; it needs list and watch on both, cluster-wide (the ClusterRole `sandman-server-capacity` of deploy/base/rbac.yaml), or to be turned off (`capacity: {{enabled: false}}`)"
    )]
    Forbidden { why: String },
}

/// Who asks: the tenant whose share the create counts against, and its weight (positive; 1 is
/// the default).
#[derive(Debug, Clone, PartialEq)]
pub struct Share {
    pub tenant: Tenant,
    pub weight: f64,
}

impl Share {
    /// The share of `spec`'s create: its tenant, and the job's weight as the server sent it.
    pub fn of_spec(spec: &sandman_provider::SandboxSpec) -> Share {
        Share::new(Tenant::of_spec(spec), spec.server.weight.unwrap_or(1.0))
    }

    /// A weight out of the server's bounds (0.001 to 1000, finite) is brought within them.
    pub fn new(tenant: Tenant, weight: f64) -> Share {
        let weight = if weight.is_finite() { weight.clamp(MIN_WEIGHT, MAX_WEIGHT) } else { 1.0 };
        Share { tenant, weight }
    }
}

const MIN_WEIGHT: f64 = 0.001;
const MAX_WEIGHT: f64 = 1000.0;

/// The gate every create passes before its pod is made.
#[derive(Debug)]
pub struct Admission {
    /// Admitted creates whose pods no node has room for (pending, for an autoscaler), at most.
    max_pending: usize,
    /// The room, the admitted creates not yet seen bound, the waiting creates. Locked briefly,
    /// never across an await.
    state: Mutex<State>,
    /// Wakes the waiters when the room changes or a create is done.
    changed: Notify,
}

#[derive(Debug, Default)]
struct State {
    room: Room,
    /// What each tenant's bound pods hold, as the watches show.
    held: Held,
    /// Admitted creates whose pods the watches do not show bound yet, by sandbox id.
    assumed: BTreeMap<String, Assumed>,
    /// The waiting creates, by ticket (the order of arrival).
    waiting: BTreeMap<u64, Waiter>,
    /// The order the waiting creates go in (see [`State::order`]), until something changes it.
    order: Option<HashMap<u64, usize>>,
    next_ticket: u64,
    /// What the first in line waits for: what everyone behind it waits for too.
    head_waits: Option<Resource>,
    /// Whether the room has been observed once: before, nothing is known and nothing goes.
    observed: bool,
    /// Why the API server refuses the watches (403), until the room is observed: creates are
    /// refused at once rather than waiting for room nothing will tell.
    forbidden: Option<String>,
}

/// An admitted create not seen bound: the node counted for it (none: admitted pending), its ask
/// and whose it is.
#[derive(Debug)]
struct Assumed {
    node: Option<String>,
    ask: Ask,
    tenant: Tenant,
}

/// One tenant's waiting creates in [`State::order`]: its weight, and (ticket, ask) in order of
/// arrival.
type Line<'a> = (f64, std::collections::VecDeque<(u64, &'a Ask)>);

#[derive(Debug)]
struct Waiter {
    tenant: Tenant,
    weight: f64,
    ask: Ask,
}

impl State {
    /// The room as seen, with the assumed creates counted on their nodes, and the pending ones
    /// on whatever room has appeared since: the scheduler places them there first.
    fn room_now(&self) -> Room {
        self.placed().0
    }

    /// Admitted creates whose pods no node has room for now: those admitted pending, and those
    /// admitted onto a node that no longer holds them. The second happen when pods reach the
    /// scheduler in another order than the gate let them through (a create's Secret or its write
    /// slot took longer): a pending pod made first takes the room counted for a later one, and
    /// that one waits in the scheduler's queue instead.
    fn pending(&self) -> usize {
        self.placed().1
    }

    /// [`State::room_now`] and [`State::pending`], in one pass over the assumed creates.
    fn placed(&self) -> (Room, usize) {
        let mut room = self.room.clone();
        let mut unplaced = Vec::new();
        for a in self.assumed.values() {
            match &a.node {
                Some(node) if room.holds(node, &a.ask) => room.take(node, &a.ask),
                _ => unplaced.push(&a.ask),
            }
        }
        for ask in &unplaced {
            if let Fit::Node(n) = room.fit(ask) {
                room.take(&n, ask);
            }
        }
        (room, unplaced.len())
    }

    /// Where the waiting create `ticket` stands (0: next). The order: the tenants other than
    /// the pools' refills take turns by least share (held and assumed room, as a dominant
    /// fraction of the nodes', over weight), each turn adding the create's ask to its tenant's
    /// share; the refills follow, in order of arrival. Computed once per change, in
    /// O(waiting · log tenants).
    fn position(&mut self, ticket: u64) -> usize {
        if self.order.is_none() {
            self.order = Some(self.order());
        }
        self.order.as_ref().and_then(|o| o.get(&ticket).copied()).unwrap_or(0)
    }

    fn order(&self) -> HashMap<u64, usize> {
        let total = self.room.total();
        let mut usage: HashMap<Tenant, f64> = HashMap::new();
        for (t, ask) in self.held.iter().chain(self.assumed.values().map(|a| (&a.tenant, &a.ask))) {
            *usage.entry(t.clone()).or_default() += ask.dominant(&total);
        }
        // Each tenant's waiting creates in order of arrival, and its weight as the latest said.
        let mut lines: BTreeMap<&Tenant, Line<'_>> = BTreeMap::new();
        for (ticket, w) in &self.waiting {
            let line = lines.entry(&w.tenant).or_default();
            line.0 = w.weight;
            line.1.push_back((*ticket, &w.ask));
        }
        let refills = lines.remove(&Tenant::Refill).map(|(_, l)| l).unwrap_or_default();
        // A min-heap of the tenants by (share over weight, their first waiting ticket). Shares
        // are finite and not negative, so their bits order as the numbers do.
        let key = |t: &Tenant, usage: f64, weight: f64, first: u64| {
            std::cmp::Reverse(((usage / weight).to_bits(), first, t.clone()))
        };
        let mut heap: BinaryHeap<_> = lines
            .iter()
            .map(|(t, (weight, line))| key(t, usage.get(*t).copied().unwrap_or(0.0), *weight, line[0].0))
            .collect();
        let mut order = HashMap::with_capacity(self.waiting.len());
        while let Some(std::cmp::Reverse((_, _, tenant))) = heap.pop() {
            let Some((weight, line)) = lines.get_mut(&tenant) else { continue };
            let Some((ticket, ask)) = line.pop_front() else { continue };
            order.insert(ticket, order.len());
            let u = usage.entry(tenant.clone()).or_default();
            *u += ask.dominant(&total);
            if let Some(&(first, _)) = line.front() {
                heap.push(key(&tenant, *u, *weight, first));
            }
        }
        for (ticket, _) in refills {
            order.insert(ticket, order.len());
        }
        order
    }

    /// Something the order depends on changed.
    fn reorder(&mut self) {
        self.order = None;
    }
}

impl Admission {
    /// At least one create at a time goes through, whatever `max_pending` says.
    pub fn new(max_pending: usize) -> Admission {
        Admission { max_pending: max_pending.max(1), state: Mutex::default(), changed: Notify::new() }
    }

    /// Replaces the room and what each tenant holds with what the watches show now. `settled`
    /// says whether a sandbox's pod is now seen on a node (its ask is in the room and in
    /// `held` then) or gone: its assumption is dropped.
    pub fn observe(&self, room: Room, held: Held, settled: impl Fn(&str) -> bool) {
        let mut s = self.lock();
        s.room = room;
        s.held = held;
        s.observed = true;
        s.forbidden = None;
        s.assumed.retain(|id, _| !settled(id));
        s.reorder();
        drop(s);
        self.changed.notify_waiters();
    }

    /// The API server refused a watch with 403 (`why`): until the room is observed, creates
    /// waiting and to come are refused with [`AdmissionError::Forbidden`].
    pub fn forbidden(&self, why: String) {
        let mut s = self.lock();
        if s.observed {
            return;
        }
        s.forbidden = Some(why);
        drop(s);
        self.changed.notify_waiters();
    }

    /// The create of `id` ended without its pod being bound (failed, or deleted): its
    /// assumption goes.
    pub fn forget(&self, id: &str) {
        let mut s = self.lock();
        if s.assumed.remove(id).is_some() {
            s.reorder();
            drop(s);
            self.changed.notify_waiters();
        }
    }

    /// Waits until `ask` may be created: when it is first in line (see the module's fair
    /// shares) and a node has room for it (counted there until its pod is bound), or none has
    /// and fewer than `max_pending` admitted creates are pending so. Tells `waiting` its place and what it waits for
    /// each time either changes. Refuses at once what no eligible node could ever hold, and
    /// gives up at `deadline`.
    pub async fn admit(
        &self,
        id: &str,
        ask: Ask,
        share: Share,
        deadline: Instant,
        mut waiting: impl FnMut(&Waiting),
    ) -> Result<(), AdmissionError> {
        let ticket = {
            let mut s = self.lock();
            let t = s.next_ticket;
            s.next_ticket += 1;
            s.waiting.insert(t, Waiter { tenant: share.tenant.clone(), weight: share.weight, ask });
            s.reorder();
            // Ahead of some who wait already (a tenant holding less): their places change.
            if s.position(t) + 1 < s.waiting.len() {
                drop(s);
                self.changed.notify_waiters();
            }
            t
        };
        let mut queued = Queued { admission: self, ticket };
        let mut last: Option<Waiting> = None;
        loop {
            // Registered before the state is read, so that no change between is missed.
            let changed = self.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            let outcome = {
                let mut s = self.lock();
                if let Some(why) = s.forbidden.clone() {
                    return Err(AdmissionError::Forbidden { why });
                }
                let position = s.position(ticket);
                // Only the first in line needs the room as it is now; the others only whether
                // they could ever fit.
                let fit = match s.room.never(&ask) {
                    Some(never) if s.observed => never,
                    _ if !s.observed => Fit::Wait(Resource::Nodes),
                    _ if position > 0 => Fit::Wait(Resource::Scheduler),
                    _ => s.room_now().fit(&ask),
                };
                let full = !s.observed || s.pending() >= self.max_pending;
                match fit {
                    Fit::Never { largest, resource } => Err(AdmissionError::NeverFits {
                        resource,
                        node: s.room.describe(&largest),
                        cpu: (ask.cpu_milli as f64 / 1000.0).to_string(),
                        memory: ask.memory,
                    }),
                    // In line: behind a create that waits, whether this one fits or not.
                    _ if position > 0 => {
                        Ok(Some(Waiting { position, resource: s.head_waits.unwrap_or(Resource::Scheduler) }))
                    }
                    Fit::Wait(resource) if full => {
                        s.head_waits = Some(resource);
                        Ok(Some(Waiting { position, resource }))
                    }
                    Fit::Node(node) => {
                        s.assumed
                            .insert(id.to_string(), Assumed { node: Some(node), ask, tenant: share.tenant.clone() });
                        Ok(None)
                    }
                    // No room now: a pending pod, within the bound, for an autoscaler to see.
                    Fit::Wait(_) => {
                        s.assumed.insert(id.to_string(), Assumed { node: None, ask, tenant: share.tenant.clone() });
                        Ok(None)
                    }
                }
            };
            let wait = match outcome {
                Err(e) => return Err(e),
                Ok(None) => {
                    queued.leave();
                    return Ok(());
                }
                Ok(Some(w)) => w,
            };
            if last.as_ref() != Some(&wait) {
                waiting(&wait);
                last = Some(wait.clone());
            }
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(AdmissionError::TimedOut { resource: wait.resource });
                }
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A place among the waiting creates, given up however the wait ends (admitted, refused,
/// cancelled).
struct Queued<'a> {
    admission: &'a Admission,
    ticket: u64,
}

impl Queued<'_> {
    fn leave(&mut self) {
        let mut s = self.admission.lock();
        if s.waiting.remove(&self.ticket).is_some() {
            s.reorder();
            drop(s);
            // The next in line may go now.
            self.admission.changed.notify_waiters();
        }
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.leave();
    }
}

/// Keeps `gate`'s room up to date until cancelled: one watch of every Node, one of every pod of
/// the cluster not ended (the scheduler's view: other teams' pods take room too), each into a
/// reflector store; after each batch of events the room and what each tenant holds are computed
/// again, and the creates whose pods are now seen on a node stop being assumed. Before both have listed once the room
/// is empty, so creates wait.
pub async fn watch(
    client: kube::Client,
    config: KubeConfig,
    gate: std::sync::Arc<Admission>,
    cancel: CancellationToken,
) {
    use futures_util::{FutureExt, StreamExt};
    use kube::ResourceExt;
    use kube::runtime::{WatchStreamExt, reflector, watcher};

    let (nodes, node_writer) = reflector::store::<Node>();
    let (pods, pod_writer) = reflector::store::<Pod>();
    // The stores keep only what the room is computed from: no managed fields, no node's image
    // list, no pod's annotations or status beyond its phase (the pod store holds every pod of
    // the cluster).
    let node_events = watcher(kube::Api::<Node>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .modify(|node| {
            node.managed_fields_mut().clear();
            if let Some(status) = node.status.as_mut() {
                status.images = None;
            }
        })
        .reflect(node_writer)
        .map(|e| e.err().map(|e| (e.to_string(), forbidden(&e))));
    let live = watcher::Config::default().fields("status.phase!=Succeeded,status.phase!=Failed");
    let pod_events = watcher(kube::Api::<Pod>::all(client), live)
        .default_backoff()
        .modify(slim)
        .reflect(pod_writer)
        .map(|e| e.err().map(|e| (e.to_string(), forbidden(&e))));
    let mut events = std::pin::pin!(futures_util::stream::select(node_events, pod_events));
    loop {
        let next = tokio::select! {
            _ = cancel.cancelled() => return,
            next = events.next() => next,
        };
        let failed = |(err, forbidden): (String, Option<String>)| {
            tracing::warn!(%err, "capacity watch failed; resuming");
            if let Some(why) = forbidden {
                gate.forbidden(why);
            }
        };
        match next {
            None => return,
            Some(Some(err)) => failed(err),
            Some(None) => {}
        }
        // The rest of the batch first: one computation for many events.
        while let Some(Some(next)) = events.next().now_or_never() {
            if let Some(err) = next {
                failed(err);
            }
        }
        if nodes.wait_until_ready().now_or_never().is_none() || pods.wait_until_ready().now_or_never().is_none() {
            continue;
        }
        let (all_nodes, all_pods) = (nodes.state(), pods.state());
        let room = Room::observe(all_nodes.iter().map(AsRef::as_ref), all_pods.iter().map(AsRef::as_ref), &config);
        let bound: std::collections::HashSet<&str> = all_pods
            .iter()
            .filter(|p| p.metadata.namespace.as_deref() == Some(config.namespace.as_str()))
            .filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_some()))
            .filter_map(|p| crate::pod::sandbox_id(&p.metadata))
            .collect();
        let held = held(all_pods.iter().map(AsRef::as_ref), &config);
        gate.observe(room, held, |id| bound.contains(id));
    }
}

/// What the room needs of a pod: its labels, node, requests and phase.
fn slim(pod: &mut Pod) {
    use kube::ResourceExt;

    pod.managed_fields_mut().clear();
    pod.annotations_mut().clear();
    if let Some(status) = pod.status.as_mut() {
        *status = k8s_openapi::api::core::v1::PodStatus { phase: status.phase.take(), ..Default::default() };
    }
}

/// The API server's message when it refused a watch with 403 (the RBAC is missing), which no
/// retry mends.
fn forbidden(e: &kube::runtime::watcher::Error) -> Option<String> {
    use kube::runtime::watcher::Error;
    let status = match e {
        Error::InitialListFailed(kube::Error::Api(s))
        | Error::WatchStartFailed(kube::Error::Api(s))
        | Error::WatchFailed(kube::Error::Api(s))
        | Error::WatchError(s) => s,
        _ => return None,
    };
    (status.code == 403).then(|| status.message.clone())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    /// A real kubelet's Node, recorded from the local v1.36 cluster: 2 cpu, 24581252Ki, 250 pods.
    fn node() -> Node {
        serde_json::from_str(include_str!("../tests/fixtures/node-kubelet-ready.json")).unwrap()
    }

    /// The recorded running sandbox pod (task 100m/64Mi, init 10m/16Mi), on `node`.
    fn pod_on(name: &str, node: &str) -> Pod {
        let mut pod: Pod = serde_json::from_str(include_str!("../tests/fixtures/pod-running-ready.json")).unwrap();
        pod.metadata.name = Some(name.to_string());
        pod.spec.as_mut().unwrap().node_name = Some(node.to_string());
        pod
    }

    fn config() -> KubeConfig {
        KubeConfig { namespace: "ns".into(), daemon_image: "d".into(), ..KubeConfig::default() }
    }

    /// A create of no job, weight 1.
    fn any() -> Share {
        Share::new(Tenant::NoJob, 1.0)
    }

    fn cpu(milli: u64) -> Ask {
        Ask { cpu_milli: milli, memory: 64 << 20, pods: 1 }
    }

    #[test]
    fn a_pods_ask_is_its_containers_sum_or_its_largest_init_container() {
        let pod = pod_on("p", "node-1");
        assert_eq!(Ask::of_pod(&pod), Ask { cpu_milli: 100, memory: 64 << 20, pods: 1 });
        let mut big_init = pod.clone();
        let init = &mut big_init.spec.as_mut().unwrap().init_containers.as_mut().unwrap()[0];
        init.resources
            .as_mut()
            .unwrap()
            .requests
            .as_mut()
            .unwrap()
            .insert("cpu".into(), k8s_openapi::apimachinery::pkg::api::resource::Quantity("1500m".into()));
        assert_eq!(Ask::of_pod(&big_init).cpu_milli, 1500);
    }

    #[test]
    fn the_room_of_a_node_is_its_allocatable_less_its_live_pods() {
        let mut ended = pod_on("done", "node-1");
        ended.status.as_mut().unwrap().phase = Some("Succeeded".into());
        let pods = [pod_on("a", "node-1"), pod_on("b", "node-1"), pod_on("elsewhere", "vm"), ended];
        let room = Room::observe([&node()], &pods, &config());
        assert_eq!(room.nodes.len(), 1);
        let n = &room.nodes[0];
        assert_eq!(n.allocatable, Ask { cpu_milli: 2000, memory: 24_581_252 * 1024, pods: 250 });
        assert_eq!(n.requested, Ask { cpu_milli: 200, memory: 128 << 20, pods: 2 });
    }

    #[test]
    fn nodes_not_ready_cordoned_tainted_or_unselected_hold_nothing() {
        let mut not_ready = node();
        for c in not_ready.status.as_mut().unwrap().conditions.as_mut().unwrap() {
            if c.type_ == "Ready" {
                c.status = "False".into();
            }
        }
        let mut cordoned = node();
        cordoned.spec.get_or_insert_default().unschedulable = Some(true);
        let mut tainted = node();
        tainted.spec.get_or_insert_default().taints = Some(vec![k8s_openapi::api::core::v1::Taint {
            key: "gpu".into(),
            effect: "NoSchedule".into(),
            ..Default::default()
        }]);
        for n in [not_ready, cordoned, tainted] {
            assert!(!eligible(&n, &config()), "{:?}", n.spec);
            assert_eq!(Room::observe([&n], [], &config()).fit(&cpu(100)), Fit::Wait(Resource::Nodes));
        }
        let selective = KubeConfig { node_selector: [("pool".into(), "sandbox".into())].into(), ..config() };
        assert!(!eligible(&node(), &selective));
        assert!(eligible(&node(), &config()));
    }

    #[test]
    fn a_request_bigger_than_the_largest_node_never_fits_and_names_it() {
        let room = Room::observe([&node()], [], &config());
        assert_eq!(room.fit(&cpu(64_000)), Fit::Never { largest: "node-1".into(), resource: Resource::Cpu });
        assert_eq!(room.fit(&cpu(2000)), Fit::Node("node-1".into()));
        // Full now, but it would fit the node empty: it waits.
        let pods: Vec<Pod> = (0..20).map(|i| pod_on(&format!("p{i}"), "node-1")).collect();
        let full = Room::observe([&node()], &pods, &config());
        assert_eq!(full.fit(&cpu(100)), Fit::Wait(Resource::Cpu));
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_goes_before_the_room_is_known() {
        let gate = Arc::new(Admission::new(4));
        let deadline = Instant::now() + Duration::from_secs(600);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let big = {
            let gate = gate.clone();
            tokio::spawn(async move {
                gate.admit("big", cpu(64_000), any(), deadline, |w| tx.send(w.clone()).unwrap()).await
            })
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(rx.try_recv().unwrap(), Waiting { position: 0, resource: Resource::Nodes });
        assert!(gate.lock().assumed.is_empty(), "admitted before the nodes were known");
        // Once the nodes are known, what can never fit is refused.
        gate.observe(Room::observe([&node()], [], &config()), Held::new(), |_| false);
        let err = big.await.unwrap().unwrap_err();
        assert!(matches!(err, AdmissionError::NeverFits { .. }), "{err:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn without_the_rbac_for_the_watches_creates_are_refused_at_once_naming_it() {
        let gate = Arc::new(Admission::new(4));
        let deadline = Instant::now() + Duration::from_secs(600);
        let waiting = {
            let gate = gate.clone();
            tokio::spawn(async move { gate.admit("early", cpu(100), any(), deadline, |_| {}).await })
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        let why = r#"pods is forbidden: User "system:serviceaccount:sandman-system:sandman-server" cannot list resource "pods""#;
        gate.forbidden(why.to_string());
        // The one waiting already, and the next, both at once: not at the deadline.
        let err = waiting.await.unwrap().unwrap_err();
        assert!(matches!(&err, AdmissionError::Forbidden { why: w } if w == why), "{err:?}");
        assert!(err.to_string().contains("sandman-server-capacity"), "{err}");
        assert!(err.to_string().contains("capacity: {enabled: false}"), "{err}");
        let err = gate.admit("late", cpu(100), any(), deadline, |_| {}).await.unwrap_err();
        assert!(matches!(err, AdmissionError::Forbidden { .. }), "{err:?}");
        assert!(Instant::now() < deadline, "it waited for the deadline");
        // Granted, and the room seen: creates go again, and a later 403 changes nothing.
        gate.observe(Room::observe([&node()], [], &config()), Held::new(), |_| false);
        gate.forbidden(why.to_string());
        gate.admit("after", cpu(100), any(), deadline, |_| {}).await.unwrap();
    }

    #[test]
    fn a_403_is_told_from_other_watch_failures() {
        let status = |code| {
            Box::new(kube::core::Status { code, message: "pods is forbidden".into(), ..kube::core::Status::default() })
        };
        use kube::runtime::watcher::Error;
        let said = Some("pods is forbidden".to_string());
        assert_eq!(forbidden(&Error::InitialListFailed(kube::Error::Api(status(403)))), said);
        assert_eq!(forbidden(&Error::WatchStartFailed(kube::Error::Api(status(403)))), said);
        assert_eq!(forbidden(&Error::WatchError(status(403))), said);
        assert_eq!(forbidden(&Error::InitialListFailed(kube::Error::Api(status(500)))), None);
        assert_eq!(forbidden(&Error::WatchError(status(410))), None);
        assert_eq!(forbidden(&Error::NoResourceVersion), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_create_that_can_never_fit_is_refused_at_once_naming_the_largest_node() {
        let gate = Admission::new(4);
        gate.observe(Room::observe([&node()], [], &config()), Held::new(), |_| false);
        let err =
            gate.admit("big", cpu(64_000), any(), Instant::now() + Duration::from_secs(600), |_| {}).await.unwrap_err();
        assert!(matches!(err, AdmissionError::NeverFits { resource: Resource::Cpu, .. }), "{err:?}");
        assert!(err.to_string().contains("`node-1` (2 cpu"), "{err}");
    }

    /// Sees every admitted create's pod bound to node-1 (those the room holds) and answers the
    /// ids admitted since the last call.
    async fn settle(
        gate: &Admission,
        pods: &mut Vec<Pod>,
        rx: &mut tokio::sync::mpsc::UnboundedReceiver<(String, Result<(), AdmissionError>, Vec<Waiting>)>,
        bind: usize,
    ) -> Vec<String> {
        tokio::time::sleep(Duration::from_millis(1)).await;
        let mut admitted = Vec::new();
        while let Ok((id, r, _)) = rx.try_recv() {
            assert!(r.is_ok(), "{id}: {r:?}");
            admitted.push(id);
        }
        admitted.sort();
        let unbound: Vec<String> = gate.lock().assumed.keys().cloned().collect();
        for id in unbound.iter().take(bind) {
            pods.push(pod_on(id, "node-1"));
        }
        let bound: Vec<String> = pods.iter().filter_map(|p| p.metadata.name.clone()).collect();
        gate.observe(Room::observe([&node()], pods.iter(), &config()), Held::new(), |id| bound.iter().any(|b| b == id));
        admitted
    }

    /// 40 creates of 100m on the recorded 2-cpu node with one pod of 100m on it already: the 19
    /// the node holds go at once, whether or not the scheduler has bound any yet (a burst on a
    /// roomy cluster is not held back); 4 more go as pending pods for an autoscaler (the bound),
    /// and the other 17 wait, in order, for cpu. When 6 sandboxes end, the 4 pending pods are
    /// bound there, 2 more go there and 4 as pending pods; the rest wait until their deadline and
    /// end timed out.
    #[tokio::test(start_paused = true)]
    async fn a_burst_beyond_the_room_waits_in_order_and_goes_as_room_appears() {
        let gate = Arc::new(Admission::new(4));
        let mut pods = vec![pod_on("other-team", "node-1")];
        gate.observe(Room::observe([&node()], &pods, &config()), Held::new(), |_| false);
        let deadline = Instant::now() + Duration::from_secs(600);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for i in 0..40 {
            let (gate, tx) = (gate.clone(), tx.clone());
            tasks.push(tokio::spawn(async move {
                let id = format!("s{i:02}");
                let mut seen = Vec::new();
                let r = gate.admit(&id, cpu(100), any(), deadline, |w| seen.push(w.clone())).await;
                let _ = tx.send((id, r, seen));
            }));
            // Each in its turn, so that the order of arrival is known.
            tokio::task::yield_now().await;
        }
        // Nothing bound yet: the 19 that fit and 4 pending ones went; the scheduler then binds
        // the 19.
        let first = settle(&gate, &mut pods, &mut rx, 19).await;
        assert_eq!(first.len(), 23, "{first:?}");
        assert_eq!(gate.lock().assumed.keys().collect::<Vec<_>>(), ["s19", "s20", "s21", "s22"]);
        assert_eq!(gate.lock().pending(), 4);
        assert_eq!(gate.lock().waiting.len(), 17);
        assert!(settle(&gate, &mut pods, &mut rx, 0).await.is_empty(), "a create went with the bound reached");

        // Six sandboxes end; the scheduler binds the four pending pods there; two more go onto
        // the room left, and four as pending pods again (the bound).
        pods.drain(1..7);
        assert!(settle(&gate, &mut pods, &mut rx, 4).await.is_empty());
        let next = settle(&gate, &mut pods, &mut rx, 0).await;
        assert_eq!(next, ["s23", "s24", "s25", "s26", "s27", "s28"]);
        assert_eq!(gate.lock().pending(), 4);

        // The rest wait until their deadline and end timed out, waiting for cpu.
        tokio::time::sleep_until(deadline + Duration::from_millis(1)).await;
        let mut timed_out = 0;
        while let Ok((id, r, seen)) = rx.try_recv() {
            assert_eq!(r, Err(AdmissionError::TimedOut { resource: Resource::Cpu }), "{id}");
            assert!(seen.iter().any(|w| w.resource == Resource::Cpu), "{id}: {seen:?}");
            timed_out += 1;
        }
        assert_eq!(timed_out, 11);
        for t in tasks {
            t.await.unwrap();
        }
        assert!(gate.lock().waiting.is_empty(), "a place in the queue outlived its wait");
    }

    /// Pods reach the scheduler in another order than the gate let them through: a pending pod
    /// made first is bound to the room counted for a create admitted onto the node, which then
    /// waits in the scheduler's queue. It counts among the pending ones, so that the API server
    /// never holds more pods no node has room for than `max_pending` (it held 4 for a bound of
    /// 2 on a real kubelet's node).
    #[tokio::test(start_paused = true)]
    async fn a_create_whose_room_a_pending_pod_took_counts_as_pending() {
        let gate = Arc::new(Admission::new(2));
        // 18 of the node's 20 places of 100m taken: x1 and x2 fit, p1 and p2 go pending.
        let mut pods: Vec<Pod> = (0..18).map(|i| pod_on(&format!("o{i}"), "node-1")).collect();
        gate.observe(Room::observe([&node()], &pods, &config()), Held::new(), |_| false);
        let deadline = Instant::now() + Duration::from_secs(600);
        for id in ["x1", "x2", "p1", "p2"] {
            gate.admit(id, cpu(100), any(), deadline, |w| panic!("{id}: {w}")).await.unwrap();
        }
        assert_eq!(gate.lock().pending(), 2);
        // The scheduler binds p1 where x1's room was counted; x1 waits in its queue.
        pods.push(pod_on("p1", "node-1"));
        gate.observe(Room::observe([&node()], &pods, &config()), Held::new(), |id| id == "p1");
        assert_eq!(gate.lock().pending(), 2, "p2, and one of x1 and x2 that the node no longer holds");
        let next = {
            let gate = gate.clone();
            tokio::spawn(async move { gate.admit("next", cpu(100), any(), deadline, |_| {}).await })
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(!next.is_finished(), "a third pod no node has room for went, over the bound of 2");
        // x2 is bound; p2 and x1 still wait: still the bound.
        pods.push(pod_on("x2", "node-1"));
        gate.observe(Room::observe([&node()], &pods, &config()), Held::new(), |id| id == "x2");
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(!next.is_finished(), "a third pod no node has room for went, over the bound of 2");
        // Two sandboxes end: x1 and p2 are bound there, and the next goes pending.
        pods.drain(0..2);
        pods.push(pod_on("x1", "node-1"));
        pods.push(pod_on("p2", "node-1"));
        gate.observe(Room::observe([&node()], &pods, &config()), Held::new(), |id| id == "x1" || id == "p2");
        next.await.unwrap().unwrap();
        assert_eq!(gate.lock().pending(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_learns_its_place_and_a_cancelled_wait_gives_it_up() {
        let gate = Arc::new(Admission::new(1));
        let pods: Vec<Pod> = (0..20).map(|i| pod_on(&format!("p{i}"), "node-1")).collect();
        gate.observe(Room::observe([&node()], &pods, &config()), Held::new(), |_| false);
        let deadline = Instant::now() + Duration::from_secs(600);
        // The node is full; one pending pod, the bound, goes for an autoscaler to see.
        gate.admit("pending", cpu(100), any(), deadline, |w| panic!("{w}")).await.unwrap();
        let first = {
            let gate = gate.clone();
            tokio::spawn(async move { gate.admit("first", cpu(100), any(), deadline, |_| {}).await })
        };
        tokio::task::yield_now().await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let second = {
            let gate = gate.clone();
            tokio::spawn(async move {
                gate.admit("second", cpu(100), any(), deadline, |w| tx.send(w.clone()).unwrap()).await
            })
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        let w = rx.try_recv().unwrap();
        assert_eq!(w, Waiting { position: 1, resource: Resource::Cpu });
        assert_eq!(w.to_string(), "waiting for capacity (cpu), position 2 in the queue");
        // The first gives up (its create was cancelled): the second moves up.
        first.abort();
        let _ = first.await;
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(rx.try_recv().unwrap(), Waiting { position: 0, resource: Resource::Cpu });
        second.abort();
        let _ = second.await;
        assert!(gate.lock().waiting.is_empty());
    }

    fn job(name: &str, weight: f64) -> Share {
        Share::new(Tenant::Job(name.into()), weight)
    }

    /// The order the waiting creates of `state` go in, as the tickets' ids.
    fn order_of(state: &State, ids: &BTreeMap<u64, &str>) -> Vec<String> {
        let order = state.order();
        let mut by_place: Vec<(usize, u64)> = order.iter().map(|(t, p)| (*p, *t)).collect();
        by_place.sort();
        by_place.iter().map(|(_, t)| ids[t].to_string()).collect()
    }

    /// A state with the recorded node's room and `waiting` creates (id, share, ask) queued in
    /// that order.
    fn waiting_state<'a>(held: Held, waiting: &[(&'a str, Share, Ask)]) -> (State, BTreeMap<u64, &'a str>) {
        let mut state =
            State { room: Room::observe([&node()], [], &config()), held, observed: true, ..State::default() };
        let mut ids = BTreeMap::new();
        for (ticket, (id, share, ask)) in waiting.iter().enumerate() {
            let ticket = ticket as u64;
            state.waiting.insert(ticket, Waiter { tenant: share.tenant.clone(), weight: share.weight, ask: *ask });
            ids.insert(ticket, *id);
        }
        (state, ids)
    }

    #[test]
    fn what_a_tenant_holds_is_its_own_bound_live_pods_requests() {
        let config = KubeConfig { namespace: "sandman-fixtures".into(), instance: "i".into(), ..config() };
        let ours = |name: &str, labels: &[(&str, &str)]| {
            let mut pod = pod_on(name, "node-1");
            let l = pod.metadata.labels.as_mut().unwrap();
            l.insert(LABEL_INSTANCE.into(), "i".into());
            l.remove(LABEL_JOB);
            l.extend(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            pod
        };
        let mut unbound = ours("unbound", &[(LABEL_JOB, "a")]);
        unbound.spec.as_mut().unwrap().node_name = None;
        let mut ended = ours("ended", &[(LABEL_JOB, "a")]);
        ended.status.as_mut().unwrap().phase = Some("Failed".into());
        let mut elsewhere = ours("other-namespace", &[(LABEL_JOB, "a")]);
        elsewhere.metadata.namespace = Some("other".into());
        let mut other_instance = ours("other-instance", &[(LABEL_JOB, "a")]);
        other_instance.metadata.labels.as_mut().unwrap().insert(LABEL_INSTANCE.into(), "j".into());
        let pods = [
            ours("a1", &[(LABEL_JOB, "a")]),
            ours("a2", &[(LABEL_JOB, "a")]),
            ours("b1", &[(LABEL_JOB, "b")]),
            ours("warm", &[(LABEL_POOL, "warm")]),
            ours("loose", &[]),
            unbound,
            ended,
            elsewhere,
            other_instance,
        ];
        let one = Ask { cpu_milli: 100, memory: 64 << 20, pods: 1 };
        let two = Ask { cpu_milli: 200, memory: 128 << 20, pods: 2 };
        assert_eq!(
            held(&pods, &config),
            Held::from([
                (Tenant::Job("a".into()), two),
                (Tenant::Job("b".into()), one),
                (Tenant::NoJob, one),
                (Tenant::Refill, one),
            ])
        );
    }

    #[test]
    fn a_creates_tenant_is_its_job_a_pool_refill_or_none_with_the_weight_the_server_sent() {
        let mut spec = sandman_provider::conformance::spec("s", "busybox");
        spec.server.weight = None;
        spec.job = None;
        assert_eq!(Share::of_spec(&spec), Share { tenant: Tenant::NoJob, weight: 1.0 });
        spec.labels.insert(sandman_provider::POOL_LABEL.into(), "warm".into());
        assert_eq!(Share::of_spec(&spec).tenant, Tenant::Refill);
        spec.job = Some("team/eval run".into());
        spec.server.weight = Some(3.0);
        assert_eq!(Share::of_spec(&spec), Share { tenant: Tenant::Job(label_value("team/eval run")), weight: 3.0 });
        // Out of bounds: brought within the server's.
        assert_eq!(Share::new(Tenant::NoJob, 1e9).weight, 1000.0);
        assert_eq!(Share::new(Tenant::NoJob, 0.0).weight, 0.001);
        assert_eq!(Share::new(Tenant::NoJob, f64::NAN).weight, 1.0);
    }

    /// Job `a` holds the whole node and queued first; job `b` holds nothing: `b`'s creates go
    /// first until the two hold alike, then they alternate (first come on a tie).
    #[test]
    fn the_tenant_holding_least_goes_first_not_the_first_to_come() {
        let held = Held::from([(Tenant::Job("a".into()), cpu(500))]);
        let mut waiting = Vec::new();
        for i in 0..4 {
            waiting.push((["a0", "a1", "a2", "a3"][i], job("a", 1.0), cpu(125)));
        }
        for i in 0..6 {
            waiting.push((["b0", "b1", "b2", "b3", "b4", "b5"][i], job("b", 1.0), cpu(125)));
        }
        let (state, ids) = waiting_state(held, &waiting);
        // a holds 500m of 2000m (1/4); each create is 1/16: b catches up after four.
        assert_eq!(order_of(&state, &ids), ["b0", "b1", "b2", "b3", "a0", "b4", "a1", "b5", "a2", "a3"]);
    }

    /// Two jobs waiting with nothing held share by weight: 1 to 3.
    #[test]
    fn tenants_waiting_together_go_in_proportion_to_their_weights() {
        let mut waiting = Vec::new();
        let names: Vec<String> =
            (0..8).map(|i| format!("light{i}")).chain((0..8).map(|i| format!("heavy{i}"))).collect();
        for (i, name) in names.iter().enumerate() {
            let share = if i < 8 { job("light", 1.0) } else { job("heavy", 3.0) };
            waiting.push((name.as_str(), share, cpu(125)));
        }
        let (state, ids) = waiting_state(Held::new(), &waiting);
        let order = order_of(&state, &ids);
        let first_eight: Vec<&str> = order[..8].iter().map(|id| id.trim_end_matches(char::is_numeric)).collect();
        assert_eq!(first_eight, ["light", "heavy", "heavy", "heavy", "light", "heavy", "heavy", "heavy"]);
        // Within a tenant, first come first served.
        let heavy: Vec<&String> = order.iter().filter(|id| id.starts_with("heavy")).collect();
        assert_eq!(heavy, names[8..].iter().collect::<Vec<_>>());
    }

    /// A pool's refills queued first still go after every job's create that waits, and the
    /// room a job's admitted creates take counts against it before their pods are seen bound.
    #[test]
    fn refills_go_last_and_admitted_creates_count_for_their_tenant() {
        let waiting = [
            ("r0", Share::new(Tenant::Refill, 1.0), cpu(125)),
            ("r1", Share::new(Tenant::Refill, 1.0), cpu(125)),
            ("a0", job("a", 1.0), cpu(125)),
            ("b0", job("b", 1.0), cpu(125)),
            ("a1", job("a", 1.0), cpu(125)),
            ("b1", job("b", 1.0), cpu(125)),
        ];
        let (mut state, ids) = waiting_state(Held::new(), &waiting);
        assert_eq!(order_of(&state, &ids), ["a0", "b0", "a1", "b1", "r0", "r1"]);
        state.assumed.insert("a-x".into(), Assumed { node: None, ask: cpu(250), tenant: Tenant::Job("a".into()) });
        assert_eq!(order_of(&state, &ids), ["b0", "b1", "a0", "a1", "r0", "r1"]);
    }

    /// Through the gate, one at a time (`max_pending` 1) on a full node: job `b`, arriving
    /// after `a`'s burst, gets the room that frees until it holds as much as `a`.
    #[tokio::test(start_paused = true)]
    async fn room_that_frees_goes_to_the_job_holding_least() {
        let gate = Arc::new(Admission::new(1));
        let tagged = |name: &str, job: &str| {
            let mut pod = pod_on(name, "node-1");
            pod.metadata.labels.as_mut().unwrap().insert(LABEL_JOB.into(), job.into());
            pod
        };
        // Job a holds the node (20 x 100m).
        let mut pods: Vec<Pod> = (0..20).map(|i| tagged(&format!("old-a{i}"), "a")).collect();
        let held_of = |pods: &[Pod]| {
            let mut held = Held::new();
            for p in pods {
                let t = held.entry(Tenant::of_pod(p)).or_default();
                *t = t.plus(&Ask::of_pod(p));
            }
            held
        };
        gate.observe(Room::observe([&node()], &pods, &config()), held_of(&pods), |_| false);
        let deadline = Instant::now() + Duration::from_secs(600);
        // One create of no job goes as a pending pod (the bound): the others all wait.
        gate.admit("x", cpu(100), any(), deadline, |w| panic!("{w}")).await.unwrap();
        let mut last = "x";
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for (id, who) in [("a0", "a"), ("a1", "a"), ("a2", "a"), ("b0", "b"), ("b1", "b"), ("b2", "b")] {
            let (gate, tx) = (gate.clone(), tx.clone());
            tokio::spawn(async move {
                gate.admit(id, cpu(100), job(who, 1.0), deadline, |_| {}).await.unwrap();
                tx.send(id).unwrap();
            });
            tokio::task::yield_now().await;
        }
        let mut admitted = Vec::new();
        for round in 0..6 {
            tokio::time::sleep(Duration::from_millis(1)).await;
            assert!(rx.try_recv().is_err(), "admitted past the bound in round {round}");
            // One of a's old sandboxes ends, and the scheduler binds the last one admitted.
            pods.remove(0);
            pods.push(tagged(last, &last[..1]));
            gate.observe(Room::observe([&node()], &pods, &config()), held_of(&pods), |s| s == last);
            tokio::time::sleep(Duration::from_millis(1)).await;
            last = rx.try_recv().unwrap_or_else(|_| panic!("nothing admitted in round {round}"));
            admitted.push(last);
        }
        assert_eq!(admitted, ["b0", "b1", "b2", "a0", "a1", "a2"]);
    }

    /// A create that goes ahead of those waiting (its job holds less) moves them back, and they
    /// are told their new places.
    #[tokio::test(start_paused = true)]
    async fn a_create_going_ahead_tells_those_behind_their_new_place() {
        let gate = Arc::new(Admission::new(1));
        let pods: Vec<Pod> = (0..20).map(|i| pod_on(&format!("p{i}"), "node-1")).collect();
        let held = Held::from([(Tenant::Job("a".into()), cpu(2000))]);
        gate.observe(Room::observe([&node()], &pods, &config()), held, |_| false);
        let deadline = Instant::now() + Duration::from_secs(600);
        gate.admit("pending", cpu(100), any(), deadline, |w| panic!("{w}")).await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let a0 = {
            let gate = gate.clone();
            tokio::spawn(async move {
                gate.admit("a0", cpu(100), job("a", 1.0), deadline, |w| tx.send(w.clone()).unwrap()).await
            })
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(rx.try_recv().unwrap().position, 0);
        let b0 = {
            let gate = gate.clone();
            tokio::spawn(async move { gate.admit("b0", cpu(100), job("b", 1.0), deadline, |_| {}).await })
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(rx.try_recv().unwrap().position, 1, "a0 was not told that b0 went ahead");
        a0.abort();
        b0.abort();
    }

    /// The capacity watch keeps every pod of the cluster slimmed to what the room needs: the
    /// room and what each tenant holds come out the same, without annotations, managed fields
    /// or status beyond the phase.
    #[test]
    fn a_slimmed_pod_counts_as_the_whole_one() {
        let config = KubeConfig { namespace: "sandman-fixtures".into(), instance: "i".into(), ..config() };
        let mut whole = pod_on("p", "node-1");
        whole.metadata.labels.as_mut().unwrap().insert(LABEL_INSTANCE.into(), "i".into());
        let mut ended = whole.clone();
        ended.metadata.name = Some("ended".into());
        ended.status.as_mut().unwrap().phase = Some("Failed".into());
        let whole = [whole, ended];
        let mut slimmed = whole.clone();
        for pod in &mut slimmed {
            slim(pod);
            assert!(pod.metadata.managed_fields.as_ref().is_none_or(|m| m.is_empty()));
            assert!(pod.metadata.annotations.as_ref().is_none_or(|a| a.is_empty()));
            assert_eq!(pod.status.as_ref().and_then(|s| s.conditions.as_ref()), None);
        }
        assert!(
            serde_json::to_string(&slimmed[0]).unwrap().len() * 2 < serde_json::to_string(&whole[0]).unwrap().len()
        );
        assert_eq!(Room::observe([&node()], &slimmed, &config), Room::observe([&node()], &whole, &config));
        assert_eq!(held(&slimmed, &config), held(&whole, &config));
        assert_eq!(held(&slimmed, &config).len(), 1);
    }
}
