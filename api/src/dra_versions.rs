//! `v1` ↔ `v1beta1` of the DRA plugin API, as the kubelet's `V1Beta1ClientWrapper` converts
//! them: field for field, `v1`'s `share_id` dropped on the way to `v1beta1`. One implementation
//! of a driver (or of the kubelet's side) serves both versions through these.

use super::dra::{v1, v1beta1};

impl From<v1beta1::Claim> for v1::Claim {
    fn from(c: v1beta1::Claim) -> Self {
        v1::Claim {
            namespace: c.namespace,
            uid: c.uid,
            name: c.name,
        }
    }
}

impl From<v1::Claim> for v1beta1::Claim {
    fn from(c: v1::Claim) -> Self {
        v1beta1::Claim {
            namespace: c.namespace,
            uid: c.uid,
            name: c.name,
        }
    }
}

impl From<v1::Device> for v1beta1::Device {
    fn from(d: v1::Device) -> Self {
        v1beta1::Device {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
        }
    }
}

impl From<v1beta1::Device> for v1::Device {
    fn from(d: v1beta1::Device) -> Self {
        v1::Device {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
            share_id: None,
        }
    }
}

impl From<v1::NodePrepareResourcesResponse> for v1beta1::NodePrepareResourcesResponse {
    fn from(r: v1::NodePrepareResourcesResponse) -> Self {
        let claims = r.claims.into_iter().map(|(uid, c)| {
            let devices = c.devices.into_iter().map(Into::into).collect();
            (
                uid,
                v1beta1::NodePrepareResourceResponse {
                    devices,
                    error: c.error,
                },
            )
        });
        v1beta1::NodePrepareResourcesResponse {
            claims: claims.collect(),
        }
    }
}

impl From<v1beta1::NodePrepareResourcesResponse> for v1::NodePrepareResourcesResponse {
    fn from(r: v1beta1::NodePrepareResourcesResponse) -> Self {
        let claims = r.claims.into_iter().map(|(uid, c)| {
            let devices = c.devices.into_iter().map(Into::into).collect();
            (
                uid,
                v1::NodePrepareResourceResponse {
                    devices,
                    error: c.error,
                },
            )
        });
        v1::NodePrepareResourcesResponse {
            claims: claims.collect(),
        }
    }
}

impl From<v1::NodeUnprepareResourcesResponse> for v1beta1::NodeUnprepareResourcesResponse {
    fn from(r: v1::NodeUnprepareResourcesResponse) -> Self {
        let claims = r.claims.into_iter().map(|(uid, c)| {
            (
                uid,
                v1beta1::NodeUnprepareResourceResponse { error: c.error },
            )
        });
        v1beta1::NodeUnprepareResourcesResponse {
            claims: claims.collect(),
        }
    }
}

impl From<v1beta1::NodeUnprepareResourcesResponse> for v1::NodeUnprepareResourcesResponse {
    fn from(r: v1beta1::NodeUnprepareResourcesResponse) -> Self {
        let claims = r
            .claims
            .into_iter()
            .map(|(uid, c)| (uid, v1::NodeUnprepareResourceResponse { error: c.error }));
        v1::NodeUnprepareResourcesResponse {
            claims: claims.collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_survives_the_round_trip_but_for_v1s_share_id() {
        let device = v1::Device {
            request_names: vec!["gpu".into()],
            pool_name: "node-a".into(),
            device_name: "gpu-0".into(),
            cdi_device_ids: vec!["k8s.gpu.example.com/gpu=uid-gpu-0".into()],
            share_id: Some("s".into()),
        };
        let answer = v1::NodePrepareResourcesResponse {
            claims: [(
                "uid".to_string(),
                v1::NodePrepareResourceResponse {
                    devices: vec![device.clone()],
                    error: "e".into(),
                },
            )]
            .into(),
        };
        let back: v1::NodePrepareResourcesResponse =
            v1beta1::NodePrepareResourcesResponse::from(answer).into();
        let got = &back.claims["uid"];
        assert_eq!(got.error, "e");
        assert_eq!(
            got.devices,
            [v1::Device {
                share_id: None,
                ..device
            }]
        );
    }
}
