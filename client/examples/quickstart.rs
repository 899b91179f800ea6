//! The SDK in one page: publish a few events, consume them in a group, ACK each and wait for
//! the DURABLE answer of the last one.
//!
//! Start an instance first (`emctl up`, or `scripts/run.sh`), then:
//!
//! ```sh
//! cargo run -p eventmesh-client --example quickstart -- http://127.0.0.1:50051
//! ```

use std::time::Duration;

use eventmesh_client::{
    AckOutcome, Client, ClientConfig, ClientError, Event, StartPosition, SubscribeOptions,
};

#[tokio::main]
async fn main() -> Result<(), ClientError> {
    let endpoint = std::env::args()
        .nth(1)
        .unwrap_or_else(|| eventmesh_client::DEFAULT_ENDPOINT.to_owned());
    let client = Client::connect(ClientConfig::new("quickstart-1").endpoint(endpoint)).await?;

    for n in 0..5 {
        let stored = client
            .publish_with_key(
                "quickstart",
                &format!("customer-{}", n % 2),
                Event {
                    source: "/quickstart".into(),
                    r#type: "order.created".into(),
                    data: format!("order {n}").into_bytes().into(),
                    ..Event::default()
                },
            )
            .await?;
        println!(
            "published {} at partition {} offset {}",
            stored.event_id, stored.partition, stored.offset
        );
    }

    let mut subscription = client
        .subscribe(
            SubscribeOptions::new("quickstart")
                .group("quickstart-readers")
                .start(StartPosition::Earliest),
        )
        .await?;
    let mut received = 0;
    while received < 5 {
        let Ok(Some(delivery)) =
            tokio::time::timeout(Duration::from_secs(10), subscription.next()).await
        else {
            println!("nothing more within 10 s");
            break;
        };
        let delivery = delivery?;
        received += 1;
        println!(
            "delivery {} (attempt {}) of event {}: {}",
            delivery.id,
            delivery.attempt,
            delivery.event.id,
            String::from_utf8_lossy(&delivery.event.data)
        );
        if received < 5 {
            delivery.ack();
        } else {
            let outcome = delivery.ack_and_wait().await?;
            assert_eq!(outcome, AckOutcome::Durable);
            println!("last ACK answered {outcome:?}");
        }
    }
    println!("{:?}", subscription.stats());
    subscription.close().await;
    Ok(())
}
