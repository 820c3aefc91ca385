//! The authenticated link's handshake and records: whatever
//! bytes a peer without the key sends, no byte passes as checked, no
//! proof is accepted, and nothing panics.
//!
//! The first input byte picks a mode. 0: the bytes are a client's, fed in
//! pieces to a server end (`RecordLink`): its plain output stays empty.
//! 1: the bytes are a server's answer to a client's hello: the client
//! refuses it. 2: the bytes are a record header and tags for a session
//! the fuzzer holds no key of: refused.

#![no_main]

use lake_dp::auth::handshake::SERVER_HELLO_BYTES;
use lake_dp::auth::{ClientHandshake, LinkKey, RecordLink, ServerHandshake};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let key = LinkKey::from_bytes([0x5a; 32]);
    match mode % 3 {
        0 => {
            let mut server = RecordLink::server(&key, 2, 1 << 16);
            let (mut plain, mut wire) = (Vec::new(), Vec::new());
            for chunk in rest.chunks(37) {
                if server.receive(chunk, &mut plain, &mut wire).is_err() {
                    break;
                }
            }
            assert!(plain.is_empty(), "bytes passed as checked without the key");
        }
        1 => {
            let (client, _) = ClientHandshake::start(&key, 1, [3; 32]);
            let Some(answer) = rest.get(..SERVER_HELLO_BYTES) else { return };
            let mut fixed = [0u8; SERVER_HELLO_BYTES];
            fixed.copy_from_slice(answer);
            assert!(client.finish(&fixed).is_err(), "an answer forged without the key was taken");
        }
        _ => {
            let (client, hello) = ClientHandshake::start(&key, 1, [1; 32]);
            let Ok((server, answer)) = ServerHandshake::answer(&key, 2, [2; 32], &hello) else { return };
            let Ok((finish, _, _)) = client.finish(&answer) else { return };
            let Ok((mut session, _)) = server.finish(&finish) else { return };
            let Some(header) = rest.get(..4) else { return };
            let Some(tags) = rest.get(4..36) else { return };
            let mut fixed = [0u8; 32];
            fixed.copy_from_slice(tags);
            assert!(session.open_header(header, &fixed).is_err(), "a tag forged without the key was taken");
        }
    }
});
