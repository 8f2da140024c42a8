//! Order bells: how a host agent's open `WatchOrders` stream hears that the
//! coordinator has new orders for its host (an assignment, a destroy order)
//! without waiting for its next heartbeat.
//!
//! A write transaction names the hosts it gave orders to
//! ([`super::WriteTx::ring`]); its commit rings their bells here, and on
//! PostgreSQL announces them to every replica (`NOTIFY`), whose relay rings
//! its own. A bell is a counter: a stream that was busy when it rang sees
//! one change for any number of rings, which is all it needs, since the
//! heartbeat it prompts carries every order due.

use std::collections::HashMap;
use std::sync::Mutex;

use cairn_proto::ids::HostId;
use tokio::sync::watch;

/// The bells of the hosts watching this replica.
#[derive(Debug, Default)]
pub struct OrderBells {
    bells: Mutex<HashMap<HostId, watch::Sender<u64>>>,
}

impl OrderBells {
    /// A receiver that changes each time `host`'s bell rings from now on.
    pub fn listen(&self, host: &HostId) -> watch::Receiver<u64> {
        let mut bells = self.bells.lock().expect("bells lock");
        bells
            .entry(host.clone())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe()
    }

    /// Forgets `host`'s bell once nobody listens to it (a stream ended).
    pub fn release(&self, host: &HostId) {
        let mut bells = self.bells.lock().expect("bells lock");
        if bells
            .get(host)
            .is_some_and(|bell| bell.receiver_count() == 0)
        {
            bells.remove(host);
        }
    }

    /// Rings `host`'s bell, if anyone listens on this replica.
    pub fn ring(&self, host: &HostId) {
        let bells = self.bells.lock().expect("bells lock");
        if let Some(bell) = bells.get(host) {
            bell.send_modify(|rung| *rung = rung.wrapping_add(1));
        }
    }

    /// Rings every bell: after announcements may have been missed (the
    /// replica's listening connection was lost), each host heartbeats once.
    pub fn ring_all(&self) {
        let bells = self.bells.lock().expect("bells lock");
        for bell in bells.values() {
            bell.send_modify(|rung| *rung = rung.wrapping_add(1));
        }
    }

    /// Hosts listening on this replica.
    #[cfg(test)]
    pub fn listening(&self) -> usize {
        self.bells.lock().expect("bells lock").len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_ring_reaches_every_listener_of_its_host_and_no_other() {
        let bells = OrderBells::default();
        let (a, b) = (HostId::generate(), HostId::generate());
        let mut first = bells.listen(&a);
        let mut second = bells.listen(&a);
        let other = bells.listen(&b);
        bells.ring(&a);
        assert!(first.has_changed().unwrap() && second.has_changed().unwrap());
        assert!(!other.has_changed().unwrap());
        first.mark_unchanged();
        // Rings while a listener is busy come to one change.
        bells.ring(&a);
        bells.ring(&a);
        first.changed().await.unwrap();
        assert!(!first.has_changed().unwrap());
        second.changed().await.unwrap();
        bells.ring_all();
        assert!(other.has_changed().unwrap());
    }

    #[test]
    fn a_bell_is_forgotten_with_its_last_listener_and_a_ring_nobody_hears_is_dropped() {
        let bells = OrderBells::default();
        let host = HostId::generate();
        bells.ring(&host);
        assert_eq!(bells.listening(), 0, "ringing makes no bell");
        let first = bells.listen(&host);
        let second = bells.listen(&host);
        drop(first);
        bells.release(&host);
        assert_eq!(bells.listening(), 1, "still heard by the second stream");
        drop(second);
        bells.release(&host);
        assert_eq!(bells.listening(), 0);
    }
}
