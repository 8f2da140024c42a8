//! Bearer-token authentication as a tower layer over the whole gRPC server.
//!
//! Sitting below tonic's router, it covers every service, reflection
//! included. Only `grpc.health.v1.Health` (Check and Watch) answers without
//! a token, so a load balancer or `grpc_health_probe` can ask; it tells
//! nothing but whether the services serve.
//!
//! With mutual TLS for hosts (`serve --tls-client-ca`), every call of the
//! host service and every call with a host token must come over a
//! connection that presented a certificate of that CA, else it is refused
//! UNAUTHENTICATED with the typed [`Refusal::ClientCertificateRequired`]:
//! a stolen host token alone registers no host.
//!
//! A request without a token is answered UNAUTHENTICATED; a token the
//! coordinator does not know PERMISSION_DENIED without a refusal; a known
//! token that is revoked, expired, or (a run token) of an attempt that is no
//! longer current PERMISSION_DENIED with the typed [`Refusal`] saying which
//! ([`tokens::admit`] decides). An admitted token's [`Principal`] is put
//! into the request extensions, where the services read it to check scopes.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;

use cairn_proto::auth::bearer_token;
use cairn_proto::refusal::Refusal;
use futures::future::BoxFuture;
use tonic::Status;
use tonic::body::Body;
use tonic::metadata::MetadataMap;
use tower::{Layer, Service};

use crate::db::MetadataStore;
use crate::tls::Peer;
use crate::tokens::{self, Principal, Scope};

/// Adds [`AuthService`] to a server.
#[derive(Debug, Clone)]
pub struct AuthLayer {
    db: Arc<MetadataStore>,
    hosts_need_certificates: bool,
}

impl AuthLayer {
    /// `hosts_need_certificates`: host calls are refused over a connection
    /// without a verified client certificate ([`Peer`]).
    pub fn new(db: Arc<MetadataStore>, hosts_need_certificates: bool) -> Self {
        Self {
            db,
            hosts_need_certificates,
        }
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = AuthService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AuthService {
            inner,
            db: self.db.clone(),
            hosts_need_certificates: self.hosts_need_certificates,
        }
    }
}

/// Resolves the bearer token of every request before the inner service sees it.
#[derive(Debug, Clone)]
pub struct AuthService<S> {
    inner: S,
    db: Arc<MetadataStore>,
    hosts_need_certificates: bool,
}

/// Resolves the token in `headers` to a principal.
async fn authenticate(db: &MetadataStore, headers: &http::HeaderMap) -> Result<Principal, Status> {
    let metadata = MetadataMap::from_headers(headers.clone());
    let Some(token) = bearer_token(&metadata) else {
        return Err(Status::unauthenticated(
            "missing bearer token (send `authorization: Bearer <token>`)",
        ));
    };
    match db.authenticating_token(&tokens::hash(token)).await {
        Ok(Some(record)) => tokens::admit(record, SystemTime::now()).map_err(refused),
        Ok(None) => Err(Status::permission_denied("the bearer token is not valid")),
        Err(e) => {
            tracing::error!(error = %e, "could not look up a bearer token");
            Err(if e.is_retryable() {
                Status::unavailable("the coordinator's database is busy; try again")
            } else {
                Status::internal("could not check the bearer token")
            })
        }
    }
}

/// The status of a known token that is not honoured.
fn refused(refusal: Refusal) -> Status {
    let message = match &refusal {
        Refusal::AttemptNotCurrent { .. } => {
            format!("{refusal}: a run token works only while its attempt is current")
        }
        _ => refusal.to_string(),
    };
    refusal.into_status(message)
}

/// The gRPC paths answered without a token: health checks only.
const OPEN_PATHS: [&str; 2] = [
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
];

/// Whether `path` is answered without a token.
fn is_open(path: &str) -> bool {
    OPEN_PATHS.contains(&path)
}

/// Whether a call is a host's: a host service method, or any call with a
/// host token.
fn is_host_call(path: &str, principal: &Principal) -> bool {
    path.starts_with("/cairn.v1.HostService/") || principal.scope == Scope::Host
}

impl<S> Service<http::Request<Body>> for AuthService<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        // The clone that was polled ready serves this call; the fresh one waits
        // for the next poll_ready.
        let fresh = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, fresh);
        let db = self.db.clone();
        let hosts_need_certificates = self.hosts_need_certificates;
        Box::pin(async move {
            if is_open(request.uri().path()) {
                return inner.call(request).await;
            }
            match authenticate(&db, request.headers()).await {
                Ok(principal) => {
                    let certified = request
                        .extensions()
                        .get::<Peer>()
                        .is_some_and(|peer| peer.verified_client_certificate);
                    if hosts_need_certificates
                        && !certified
                        && is_host_call(request.uri().path(), &principal)
                    {
                        tracing::info!(
                            path = request.uri().path(),
                            "host call without a client certificate refused"
                        );
                        return Ok(refused(Refusal::ClientCertificateRequired).into_http());
                    }
                    request.extensions_mut().insert(principal);
                    inner.call(request).await
                }
                Err(status) => Ok(status.into_http()),
            }
        })
    }
}

/// The principal the auth layer attached to a request.
pub fn principal<T>(request: &tonic::Request<T>) -> Result<&Principal, Status> {
    request.extensions().get::<Principal>().ok_or_else(|| {
        // Only reachable if a service is mounted without the auth layer.
        tracing::error!("request reached a service without passing the auth layer");
        Status::internal("request was not authenticated")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_health_checks_are_open() {
        assert!(is_open("/grpc.health.v1.Health/Check"));
        assert!(is_open("/grpc.health.v1.Health/Watch"));
        for closed in [
            "/grpc.health.v1.Health/List",
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            "/cairn.v1.AdminService/ListHosts",
            "/grpc.health.v1.Health/Check/",
            "/GRPC.HEALTH.V1.HEALTH/CHECK",
        ] {
            assert!(!is_open(closed), "{closed}");
        }
    }
}
